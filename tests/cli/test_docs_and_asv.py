"""The Sphinx docs build warning-free; the asv suite is discovered and skips without a GPU."""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys

import pytest

from conftest import GPU

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_docs_build_warning_free(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("numpydoc")
    pytest.importorskip("pydata_sphinx_theme")
    res = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                          str(ROOT / "docs"), str(tmp_path / "html")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    page = (tmp_path / "html" / "generated" / "cufused.conv2d_groupnorm_scale_maxpool_clamp.html")
    text = page.read_text()
    for section in ("Parameters", "Returns", "Raises", "Examples"):
        assert section in text
    assert "median ms" in (tmp_path / "html" / "performance.html").read_text()


def test_every_public_function_has_an_api_page():
    import cufused

    api = (ROOT / "docs" / "api.rst").read_text()
    for name in cufused.__all__:
        assert f"   {name}\n" in api, name


def test_asv_discovers_the_benchmarks():
    pytest.importorskip("asv")
    res = subprocess.run([sys.executable, "-m", "asv", "check", "--python=same"],
                         cwd=ROOT / "asv_bench", capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "No problems found" in res.stdout


@pytest.mark.parametrize("module", ["bench_pipelines", "bench_blocks"])
def test_benchmarks_import_and_skip_without_gpu(module, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "asv_bench"))
    mod = importlib.import_module(f"benchmarks.{module}")
    classes = [c for c in vars(mod).values() if isinstance(c, type) and hasattr(c, "params")]
    assert classes
    for cls in classes:
        assert callable(getattr(cls, "track_gpu_ms"))
        if not GPU:
            first = [p[0] for p in cls.params]
            with pytest.raises(NotImplementedError, match="needs a CUDA GPU"):
                cls().setup(*first)
