"""The command line without a GPU: help texts, the reference check, bench's refusal."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run([sys.executable, "-m", "cufused", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("args", [["--help"], ["check", "--help"], ["bench", "--help"]])
def test_help(args):
    res = run(*args)
    assert res.returncode == 0
    assert "usage: python -m cufused" in res.stdout
    assert "``" not in res.stdout and ":func:" not in res.stdout  # no reStructuredText markup


def test_version():
    import cufused

    res = run("--version")
    assert res.returncode == 0
    assert res.stdout.strip() == f"cufused {cufused.__version__}"


@pytest.mark.oracle
def test_check_without_gpu_compares_with_pytorch():
    from conftest import GPU

    if GPU:
        pytest.skip("a GPU is present: check runs the GPU path (covered by the GPU tests)")
    res = run("check")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("no CUDA GPU: checking cufused's CPU path")
    assert "against PyTorch" in lines[0]
    assert lines[1].startswith("metric: relative error") and "tolerance: 1e-10" in lines[1]
    # Each case says what it is: the pipeline, its shapes and options, the output shape.
    assert any(line.startswith("A: conv2d_groupnorm_scale_maxpool_clamp(x (8, 8, 64, 64)")
               and "num_groups=16" in line and line.endswith("-> (8, 64, 15, 15)")
               for line in lines)
    assert sum(line.strip().startswith("numpy float64") and " ok " in line for line in lines) == 3
    assert lines[-1] == "all checks passed"


@pytest.mark.oracle
def test_check_whose_reader_leaves_exits_without_a_traceback():
    # ``python -m cufused check | head -1``: the lines after the reader has gone are dropped.
    proc = subprocess.Popen([sys.executable, "-m", "cufused", "check"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert first.strip()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode in (0, 1)


@pytest.mark.oracle
def test_check_without_gpu_catches_a_semantic_error(monkeypatch, capsys):
    # The CPU check compares with an independent implementation: a pipeline that differs
    # from PyTorch's by a little (GroupNorm eps 1e-3 instead of 1e-5) fails it.
    import torch.nn.functional as F

    from cufused.bench import cli

    monkeypatch.setattr(cli, "gpu_unavailable_reason", lambda: "no CUDA GPU")
    group_norm = F.group_norm
    monkeypatch.setattr(F, "group_norm", lambda *a, **k: group_norm(*a, **{**k, "eps": 1e-3}))
    assert cli.main(["check", "--cases", "A"]) == 1
    out = capsys.readouterr().out
    assert " FAIL " in out and out.splitlines()[-1] == "1 check(s) FAILED"


def test_check_seed_draws_the_inputs(monkeypatch):
    # --seed picks the inputs: the same seed draws the same ones, another seed and each case
    # other ones.
    import sys

    from cufused.bench import cli
    from cufused.bench.cases import Case

    monkeypatch.setattr(cli, "gpu_unavailable_reason", lambda: "no CUDA GPU")
    monkeypatch.setitem(sys.modules, "torch", None)  # the reference alone: quicker
    drawn = []
    make_inputs = Case.make_inputs

    def recording(self, rng):
        inputs = make_inputs(self, rng)
        drawn.append(float(inputs["x"].ravel()[0]))
        return inputs

    monkeypatch.setattr(Case, "make_inputs", recording)
    runs = {}
    for seed in (1, 2, 1):
        drawn.clear()
        assert cli.main(["check", "--cases", "A", "C", "--seed", str(seed)]) == 0
        runs.setdefault(seed, []).append(list(drawn))
    assert runs[1][0] == runs[1][1] and len(runs[1][0]) == 2
    assert runs[1][0] != runs[2][0] and runs[1][0][0] != runs[1][0][1]
    # A case draws the same inputs alone as among the others (a failure found in a full
    # run reproduces with --cases).
    drawn.clear()
    assert cli.main(["check", "--cases", "C", "--seed", "1"]) == 0
    assert drawn == runs[1][0][1:]


def test_check_without_gpu_or_torch_says_so(monkeypatch, capsys):
    import sys

    from cufused.bench import cli

    monkeypatch.setattr(cli, "gpu_unavailable_reason", lambda: "no CUDA GPU")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert cli.main(["check", "--cases", "C"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("no CUDA GPU, and PyTorch is not installed")
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in lines[0]
    assert "finite: True" in lines[2]
    assert lines[-1] == "the reference ran; nothing was compared (PyTorch is not installed)"


@pytest.mark.parametrize("reason, code", [
    ("no CUDA GPU", 0), ("CuPy is not installed (the GPU path needs CuPy)", 0),
    ("CuPy is installed but cannot be imported (libnvrtc.so.13: cannot open)", 1),
    ("the NVIDIA driver supports CUDA 12.4, older than the CUDA 13.0 CuPy is built for", 1)])
def test_check_of_a_gpu_installation_that_does_not_work_fails(monkeypatch, capsys, reason,
                                                               code):
    # Without a GPU installation the CPU path's check is the whole check; with one that does
    # not work (CuPy that cannot import, a driver too old), the GPU path has not been checked.
    import sys

    from cufused.bench import cli

    monkeypatch.setattr(cli, "gpu_unavailable_reason", lambda: reason)
    monkeypatch.setitem(sys.modules, "torch", None)  # the CPU path runs the reference only
    assert cli.main(["check", "--cases", "C"]) == code
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == (f"GPU path NOT checked: {reason}" if code else
                    "the reference ran; nothing was compared (PyTorch is not installed)")


def test_a_missing_dependency_is_an_error_line_not_a_traceback(monkeypatch, capsys):
    from cufused.bench import cli

    def missing(args):
        raise ImportError("the GPU path needs cuDNN Frontend: install cufused[cuda13]")

    monkeypatch.setattr(cli, "cmd_check", missing)  # the parser takes it when built
    assert cli.main(["check"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{cli._parser().prog}: error: the GPU path needs cuDNN Frontend")
    assert "Traceback" not in err


@pytest.mark.gpu
def test_check_on_gpu_canonical_sizes_within_30_s():
    # The main job on the device: every case and path passes, with the float64 references
    # computed on the GPU, in under 30 s (issue 27's target on an H100 or H200; kernels and
    # cuDNN plans are built during the run).
    import time

    start = time.perf_counter()
    res = run("check")
    seconds = time.perf_counter() - start
    print(res.stdout)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert "float64 reference computed on the GPU" in lines[0]
    # 3 cases x 3 precisions x (fused, unfused)
    assert sum(line.strip().startswith("gpu ") and " ok " in line for line in lines) == 18
    assert lines[-1] == "all checks passed"
    assert seconds < 30, f"check took {seconds:.1f} s"


def test_bench_without_gpu_says_so():
    from conftest import GPU

    if GPU:
        pytest.skip("a GPU is present")
    res = run("bench", "--quick")
    assert res.returncode == 1
    assert "no CUDA GPU: bench needs a CUDA GPU" in res.stderr


class _CudaError(RuntimeError):
    """CuPy's CUDARuntimeError as far as the reason reads it: its message and status."""

    def __init__(self, status, name):
        super().__init__(f"{name}: ...")
        self.status = status


class _FakeRuntime:
    """CuPy's ``cuda.runtime`` as a machine without a usable GPU shows it."""

    def __init__(self, count=None, driver=0, built_for=13020, error=(35, "insufficient")):
        self.count, self.driver, self.built_for, self.error = count, driver, built_for, error

    def getDeviceCount(self):
        if self.count is None:
            raise _CudaError(*self.error)
        return self.count

    def driverGetVersion(self):
        return self.driver

    def runtimeGetVersion(self):
        return self.built_for


@pytest.mark.parametrize("runtime, reason", [
    (_FakeRuntime(driver=0), "no CUDA GPU"),  # no driver at all
    (_FakeRuntime(driver=13020, error=(100, "no device")), "no CUDA GPU"),
    (_FakeRuntime(driver=12040, built_for=12090, error=(100, "no device")), "no CUDA GPU"),
    (_FakeRuntime(count=0, driver=13020), "no CUDA GPU"),
    (_FakeRuntime(count=1, driver=13020), None),
    (_FakeRuntime(driver=12040), "the NVIDIA driver supports CUDA 12.4, older than the CUDA "
                                 "13.2 CuPy is built for: update the driver, or replace CuPy "
                                 "by its build for CUDA 12 (uninstall cupy-cuda13x, then "
                                 "install cufused[cuda12])"),
    (_FakeRuntime(driver=13000), "the NVIDIA driver supports CUDA 13.0, older than the CUDA "
                                 "13.2 CuPy is built for: update the driver"),
    # Another error with an older driver of the same major version (which CUDA's minor
    # version compatibility runs) is not the driver's.
    (_FakeRuntime(driver=13000, error=(802, "system not ready")),
     "CuPy cannot use a CUDA GPU (_CudaError: system not ready: ...)"),
])
def test_gpu_unavailable_reason_tells_what_to_do(monkeypatch, runtime, reason):
    # A driver too old for the installed CuPy is not "no GPU": the user updates the driver or
    # installs the other CuPy.
    import types

    from cufused._arrays import gpu_available, gpu_unavailable_reason

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert gpu_unavailable_reason() == reason
    assert gpu_available() is (reason is None)


def test_gpu_unavailable_reason_of_a_missing_or_broken_cupy(monkeypatch, tmp_path):
    from cufused._arrays import gpu_unavailable_reason

    monkeypatch.setitem(sys.modules, "cupy", None)  # not installed
    assert gpu_unavailable_reason().startswith("CuPy is not installed (the GPU path needs")
    # Installed, but its import fails (a library it loads is missing): not "not installed".
    package = tmp_path / "cupy"
    package.mkdir()
    (package / "__init__.py").write_text("raise OSError('libcudart.so.13: cannot open')\n")
    monkeypatch.delitem(sys.modules, "cupy")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert gpu_unavailable_reason() == ("CuPy is installed but cannot be imported "
                                        "(libcudart.so.13: cannot open)")
    (package / "__init__.py").write_text("import cupy_backends_missing\n")
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    assert gpu_unavailable_reason() == ("CuPy is installed but cannot be imported "
                                        "(No module named 'cupy_backends_missing')")


@pytest.mark.parametrize("argv0, prog", [("/usr/bin/cufused", "cufused"),
                                         ("/opt/venv/Scripts/cufused.exe", "cufused"),
                                         ("/x/cufused/__main__.py", "python -m cufused")])
def test_usage_names_how_the_command_was_started(monkeypatch, capsys, argv0, prog):
    from cufused.bench import cli

    monkeypatch.setattr(sys, "argv", [argv0])
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {prog} [-h]") and f'Run "{prog} COMMAND --help"' in out
    assert cli.main(["bench", "--plot", "out.xyz"]) == 2
    assert capsys.readouterr().err.startswith(f"{prog} bench: error: --plot")


def test_unknown_command_fails():
    assert run("frobnicate").returncode != 0


@pytest.mark.parametrize("args", [
    ("check", "--seed", "-1"), ("check", "--seed", "x"), ("check", "--cases"),
    ("bench", "--repeat", "0"), ("bench", "--repeat", "-5"), ("bench", "--precisions"),
    ("bench", "--cases"), ("bench", "--batch", "x"),
])
def test_bad_options_are_usage_errors(args):
    # argparse's usage error (status 2, a message, no traceback) before any work.
    res = run(*args)
    assert res.returncode == 2, res.stderr
    assert "error:" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_bench_refuses_an_unwritable_output_before_running(tmp_path, option):
    # The figures of a run of minutes would be lost at its end: the path is checked first,
    # with or without a GPU.
    if option == "--plot":
        pytest.importorskip("matplotlib")
    for path in (tmp_path / "missing" / "out.file", tmp_path):
        res = run("bench", "--quick", option, str(path))
        assert res.returncode == 2, res.stderr
        assert option in res.stderr and "Traceback" not in res.stderr


def test_bench_refuses_a_plot_format_before_running(tmp_path):
    # matplotlib picks the format by the extension only when it saves, after the run.
    pytest.importorskip("matplotlib")
    for name in ("out.xyz", "noextension"):
        res = run("bench", "--quick", "--plot", str(tmp_path / name))
        assert res.returncode == 2, res.stderr
        assert "--plot" in res.stderr and "Traceback" not in res.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["bench.json", "bench_h200_all.json",
                                  "bench_h200_canonical.json",
                                  "bench_h200_a_compile.json", "bench_h100.json",
                                  "bench_h100_canonical.json", "bench_h100_batch1.json",
                                  "bench_h100_batch8.json", "bench_h200_a_bands.json",
                                  "bench_h200_c_ncdhw.json", "bench_h200_c_tail.json",
                                  "bench_h200_ac_graphs.json",
                                  "bench_h200_ac_channels_last.json",
                                  "bench_h200_a_channels_last_stores.json",
                                  "bench_h200_a_held_weights.json",
                                  "bench_h200_a_held_pool.json",
                                  "bench_h200_c_groups.json",
                                  "bench_h200_ac_split.json",
                                  "bench_h200_ac_sums.json",
                                  "bench_h200_ac_issue25.json",
                                  "bench_h200_b_compile.json",
                                  "bench_h200_ab_compile.json",
                                  "bench_h200_c_compile.json",
                                  "bench_h200_issue26.json"])
def test_bench_table_and_plot_from_committed_result(tmp_path, name):
    # The committed device results (docs/_static/bench*.json, H200 and H100) render as the
    # bench command prints them, and as a bar chart.
    import json
    import pathlib

    from cufused.bench.report import format_table, plot

    result = json.loads((pathlib.Path(__file__).parents[2] / "docs" / "_static"
                         / name).read_text())
    table = format_table(result)
    assert result["header"]["device"] in table
    rows = [line for line in table.splitlines() if line[:2] in ("A ", "B ", "C ")]
    # Pipeline rows and convolution rows, and host-time rows where the result has them.
    assert len(rows) == 2 * len(result["rows"]) + sum("host_us_fused" in r
                                                      for r in result["rows"])
    first = result["rows"][0]
    assert f"{first['torch_eager'] / first['fused']:.2f}" in rows[0]
    engine = first.get("conv_engine", "epilogue" if first.get("conv_in_epilogue") else "cudnn")
    if engine != "cudnn":  # no cuDNN convolution of its own: no post-conv ratio
        assert "igemm, pass" in rows[0] and rows[0].split()[11] == "-"
    else:
        post_ratio = (first["fused"] - first["conv"]) / first["post_floor"]
        assert f"{post_ratio:7.2f} " in rows[0]
    pytest.importorskip("matplotlib")
    plot(result, str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_table_states_how_it_ran():
    # The run's options head the table (the header's nested parts are not printed raw).
    import json
    import pathlib

    from cufused.bench.report import format_table

    path = pathlib.Path(__file__).parents[2] / "docs" / "_static" / "bench_h200_issue26.json"
    result = json.loads(path.read_text())
    result["header"]["options"] = {"precisions": ["tf32"], "repeat": 20, "quick": False,
                                   "batch": None, "torch_compile": True}
    result["header"]["cases"] = {"A": {"pipeline": "p", "shapes": {"x": [1]}, "options": {}}}
    head = format_table(result).splitlines()
    assert "precisions=['tf32'] repeat=20 quick=False batch=None torch_compile=True" in head[:3]
    assert not any("pipeline" in line for line in head[:3])


def test_bench_host_table():
    # Host microseconds per call and the latency ratio: a row per case and precision.
    import json
    import pathlib

    from cufused.bench.report import format_table

    result = json.loads((pathlib.Path(__file__).parents[2] / "docs" / "_static"
                         / "bench.json").read_text())
    for r in result["rows"]:
        r.update(host_us_fused=17.5, host_us_fused_new=19.25, host_us_prepared=4.25,
                 host_us_torch_eager=210.0, fused_back_to_back=r["fused"] / 1.02,
                 prepared=r["fused"])
    lines = format_table(result).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("warm calls"))
    host = lines[start + 2:start + 2 + len(result["rows"])]
    assert all(line.split()[4:8] == ["17.5", "19.2", "4.2", "210.0"]
               and line.endswith("1.020") for line in host), host
    assert all(line.split()[8:10] == ["-", "-"] for line in host)  # no compiled rows


@pytest.mark.parametrize("fields, strategy", [
    ({"conv_engine": "epilogue"}, "igemm, pass in its epilogue"),
    ({"conv_in_epilogue": True}, "igemm, pass in its epilogue"),  # a result before conv_engine
    ({"conv_engine": "igemm"}, "igemm, pass after it"),
])
def test_bench_row_of_a_convolution_on_the_implicit_gemm(fields, strategy):
    # A pipeline whose convolution runs on the implicit GEMM runs no cuDNN plan: its row
    # shows no convolution time or post-convolution time and names the path.
    import json
    import pathlib

    from cufused.bench.report import format_table

    result = json.loads((pathlib.Path(__file__).parents[2] / "docs" / "_static"
                         / "bench.json").read_text())
    result["rows"] = [dict(result["rows"][0], **fields)]
    row = next(line for line in format_table(result).splitlines() if line.startswith("A "))
    assert row.endswith(strategy)
    cells = row.split()
    assert cells[8:10] == ["-", "-"] and cells[11] == "-"
    result["rows"] = [dict(result["rows"][0], conv_engine="cudnn")]
    row = next(line for line in format_table(result).splitlines() if line.startswith("A "))
    assert row.split()[8] == f"{result['rows'][0]['conv']:.3f}"


def test_bench_batch_option():
    from cufused.bench.cases import make_cases

    for case in make_cases(batch=3):
        assert case.shapes["x"][0] == case.conv["x_shape"][0] == 3
        assert case.output_shape[0] == 3
    assert run("bench", "--batch", "0").returncode == 2  # argparse's usage error


def test_post_conv_floor_counts_the_bytes_each_case_moves():
    from cufused.bench.cases import CASES

    by_name = {case.name: case for case in CASES}
    # A: conv output (128, 64, 126, 126) read, result (128, 64, 31, 31) written.
    assert by_name["A"].post_conv_bytes() == 4 * 128 * 64 * (126 * 126 + 31 * 31)
    # C pools its input before the conv: input read, pooled input written, then the conv
    # output read and the (same-shaped) result written.
    assert by_name["C"].post_conv_bytes() == 4 * 32 * (32 * 32 * 64 * 64 + 32 * 16 * 32 * 32
                                                       + 2 * 64 * 32 * 64 * 64)


def test_case_reference_is_the_public_pipeline():
    # check's GPU path calls cufused.reference directly (on CuPy arrays) with each case's
    # options expanded: on NumPy arrays that is the public pipeline's result.
    import numpy as np

    import cufused
    from cufused.bench.cases import make_cases, rel_err

    for i, case in enumerate(make_cases(small=True)):
        inputs = {k: v.astype(np.float64)
                  for k, v in case.make_inputs(np.random.default_rng(i)).items()}
        want = getattr(cufused, case.pipeline)(*inputs.values(), **case.options)
        assert rel_err(case.reference(inputs), want) < 1e-14, case.name


def _imported_modules(path, package_root):
    """The absolute names of the modules that a file under ``package_root``'s parent imports
    (relative imports resolved; ``from X import y`` counts as X and X.y)."""
    import ast

    package = list(path.relative_to(package_root.parent).parts[:-1])  # the file's package
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def test_the_bench_subpackage_sits_beside_the_library():
    # cufused.bench uses the library; nothing in the library imports it but the
    # ``python -m cufused`` entry, and the docs build takes the table from it, not __main__.
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    package = root / "cufused"
    for path in package.rglob("*.py"):
        if path.name == "__main__.py" or (package / "bench") in path.parents:
            continue
        imported = _imported_modules(path, package)
        assert not {m for m in imported if m == "cufused.bench"
                    or m.startswith("cufused.bench.")}, path
    assert "cufused.bench.cli" in _imported_modules(package / "__main__.py", package)
    conf = _imported_modules(root / "docs" / "conf.py", root / "docs")
    assert not {m for m in conf if m.startswith("cufused.__main__")}, conf
    assert "cufused.bench.report.format_table" in conf


def test_bench_floors():
    # The floor: the direct convolution's FLOPs at the precision's measured rate (3xTF32 a
    # third of TF32's), or the input and output at the copy bandwidth, whichever is longer;
    # no floor for a tensor-core precision without a measured TF32 rate.
    from cufused.bench.cases import make_cases
    from cufused.bench.report import _floor_cells
    from cufused.bench.timing import add_floors

    case = make_cases()[0]
    flops, nbytes = case.conv_flops(), case.io_bytes()
    rows = [{"precision": p, "fused": 1.0} for p in ("ieee", "tf32", "3xtf32")]
    add_floors(case, rows, {"copy_TBps": 4.0, "fp32_TFLOPs": 50.0, "tf32_TFLOPs": 400.0})
    byte_ms = nbytes / 4e12 * 1e3
    assert rows[0]["floor"] == pytest.approx(max(flops / 50e12 * 1e3, byte_ms))
    assert rows[1]["floor"] == pytest.approx(max(flops / 400e12 * 1e3, byte_ms))
    assert rows[2]["floor"] == pytest.approx(max(flops / (400e12 / 3) * 1e3, byte_ms))
    assert rows[1]["floor"] > byte_ms  # A's TF32 floor is its FLOPs, not its bytes
    assert rows[0]["post_floor"] == pytest.approx(case.post_conv_bytes() / 4e12 * 1e3)
    add_floors(case, rows, {"copy_TBps": 4.0, "fp32_TFLOPs": 50.0})
    assert rows[0]["floor"] is not None and rows[1]["floor"] is None is rows[2]["floor"]
    assert _floor_cells(rows[1]).split() == ["-", "-"]
    assert _floor_cells(rows[0]).split() == [f"{rows[0]['floor']:.3f}",
                                             f"{1.0 / rows[0]['floor']:.2f}"]


@pytest.mark.parametrize("name, epilogue, igemm, engine", [
    ("A", True, None, "epilogue"), ("A", False, ("igemm", "run"), "igemm"),
    ("A", False, None, "cudnn"),
    ("B", False, ("igemm", "run"), "igemm"), ("B", False, ("fft", "run"), "fft"),
    ("B", False, None, "cudnn"),
    ("C", True, None, "epilogue"), ("C", False, None, "cudnn"),
])
def test_bench_conv_engine(monkeypatch, name, epilogue, igemm, engine):
    # The benchmark asks each pipeline's own routing about the convolution it ran, with the
    # arguments the pipeline computes (and so the keys of its settled engines).
    import numpy as np

    from cufused._ops import convolution
    from cufused.bench.cases import make_cases
    from cufused.bench.timing import conv_engine
    from cufused.pipelines import pipeline_a, pipeline_c

    case = next(c for c in make_cases(small=True) if c.name == name)
    gpu = {k: np.empty(s, np.float32) for k, s in case.shapes.items()}
    asked = []
    monkeypatch.setattr(pipeline_a, "_epilogue_applies",
                        lambda xp, x, w, args, *rest: asked.append(args) or epilogue)
    monkeypatch.setattr(pipeline_c, "_recompute_applies",
                        lambda xp, x, w, args, *rest: asked.append(args) or epilogue)
    # Pipeline B's convolution feeds batch statistics (which admits the DFT engine).
    flags = []
    monkeypatch.setattr(convolution, "own_engine",
                        lambda x, w, args, precision, *, batch_statistics: asked.append(args)
                        or flags.append(batch_statistics) or igemm)
    assert conv_engine(case, gpu, "tf32") == engine
    c = case.conv
    assert all(a.transposed == (c["kind"] == "dgrad") and a.out_shape == c["y_shape"]
               for a in asked) and asked
    assert flags == ([] if name == "C" or epilogue else [name == "B"])


def test_bench_checks_the_results_it_times(capsys):
    # Each timed cufused result (its out NaN-poisoned first) against the float64 reference:
    # the errors go into the rows, and a result past its precision's tolerance fails bench.
    import numpy as np

    from cufused.bench.cli import _report_errors
    from cufused.bench.timing import RESULT_CALLS, _result_errors

    reference = np.linspace(1.0, 2.0, 12)
    out = np.empty(12, dtype=np.float32)

    def writes(values):
        def call():
            out[:len(values)] = values
            return out
        return call

    fns = {"fused": writes(reference), "prepared": writes(reference[:11]),
           "unfused": lambda: reference * (1 + 1e-3)}
    errors = _result_errors(fns, out, reference)
    assert set(errors) == {f"err_{name}" for name in RESULT_CALLS}
    assert errors["err_fused"] < 1e-7 and errors["err_prepared"] == float("inf")
    assert abs(errors["err_unfused"] - 1e-3) < 1e-9
    rows = [dict(case="A", precision="tf32", **errors)]
    assert _report_errors(rows) == 1
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1].startswith("FAIL A tf32 prepared: inf")
    rows[0]["err_prepared"] = 0.0
    assert _report_errors(rows) == 0
    assert "tf32 1.0e-03 (< 5e-03)" in capsys.readouterr().out
