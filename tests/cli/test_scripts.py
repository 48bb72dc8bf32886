"""The contributor tools under scripts/ without a GPU: every Python script compiles, names only
modules and names that exist, documents its usage and answers ``--help`` (a helper module
imports); the shell scripts parse; every ``scripts/...`` path the repository mentions exists;
the halo kernels' emulation passes. (``bench_dask.py --small``, a CPU run of that script, is in
integrations/test_dask_graph.py.)"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import pathlib
import py_compile
import re
import subprocess
import sys

import pytest

from cufused._arrays import gpu_available

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
PYTHON_SCRIPTS = sorted(SCRIPTS.glob("*.py"))
SHELL_SCRIPTS = sorted(SCRIPTS.glob("*.sh"))
# Third-party packages the scripts may import; anything else must be the standard library,
# cufused or a script beside them.
EXTERNAL = {"cupy", "cupyx", "numpy", "torch", "dask", "distributed", "dask_cuda"}
HAS_CUPY = importlib.util.find_spec("cupy") is not None


def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _is_command(path: pathlib.Path) -> bool:
    """Whether the script has an ``if __name__ == "__main__":`` block."""
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
               for node in _tree(path).body)


def _top_level_names(path: pathlib.Path) -> set[str]:
    names = set()
    for node in _tree(path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


COMMANDS = [p for p in PYTHON_SCRIPTS if _is_command(p)]
HELPERS = [p for p in PYTHON_SCRIPTS if not _is_command(p)]


def test_the_contributor_tools_are_there():
    names = {p.name for p in PYTHON_SCRIPTS + SHELL_SCRIPTS}
    assert names >= {"gpu_check.sh", "ncu_kernels.sh", "bench_dask.py", "profile_pipelines.py",
                     "sanitize.py",
                     "host_breakdown.py", "time_pipelines.py", "pipeline_calls.py",
                     "host_time.py"}, names
    assert {p.name for p in HELPERS} == {"pipeline_calls.py"}


@pytest.mark.parametrize("path", PYTHON_SCRIPTS, ids=lambda p: p.name)
def test_script_compiles(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "script.pyc"), doraise=True)


@pytest.mark.parametrize("path", PYTHON_SCRIPTS, ids=lambda p: p.name)
def test_script_imports_only_what_exists(path):
    """Each import names the standard library, a known package, a script beside it (and a
    name it defines) or cufused (and a name it has): a script must not outlive a helper or a
    library name it relies on."""
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            modules = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            modules = [(node.module, [a.name for a in node.names])]
        else:
            continue
        for module, names in modules:
            top = module.split(".")[0]
            sibling = SCRIPTS / f"{top}.py"
            if sibling.exists():
                missing = set(names) - _top_level_names(sibling)
                assert not missing, f"{path.name}: {sorted(missing)} not in {sibling.name}"
            elif top == "cufused":
                mod = importlib.import_module(module)
                for name in names:
                    assert (hasattr(mod, name)
                            or importlib.util.find_spec(f"{module}.{name}") is not None), \
                        f"{path.name}: {module}.{name} does not exist"
            else:
                assert top in sys.stdlib_module_names or top in EXTERNAL, \
                    f"{path.name} imports {module}, which is neither a script nor known"


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: p.name)
def test_script_documents_its_usage(path):
    doc = ast.get_docstring(_tree(path))
    assert doc and f"Usage: python scripts/{path.name}" in doc


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: p.name)
def test_script_help_runs_without_a_gpu(path):
    """``--help`` runs the script's imports (CuPy imports without a GPU) and prints its usage."""
    if not HAS_CUPY:
        pytest.skip("the script imports CuPy; without it only compilation and imports are checked")
    res = subprocess.run([sys.executable, str(path), "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "usage" in res.stdout.lower(), res.stdout


@pytest.mark.parametrize("path", HELPERS, ids=lambda p: p.name)
def test_helper_imports_without_a_gpu(path):
    if not HAS_CUPY:
        pytest.skip("the helper imports CuPy; without it only compilation and imports are checked")
    res = subprocess.run([sys.executable, "-c", f"import {path.stem}"], cwd=SCRIPTS,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


def test_conv_halo_emulation_matches_the_reference():
    """scripts/emulate_conv_halo.py: conv_gemm.cu's halo kernels' index math (tiles, staging,
    fragments, the staged output rows, the pooling epilogue, the wgmma weight layouts, the
    bands of whole rows and their copies) emulated in NumPy against the float64 definitions."""
    res = subprocess.run([sys.executable, str(SCRIPTS / "emulate_conv_halo.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(": max error ") == 7 and res.stdout.count(": ok") == 3, res.stdout


def test_conv_transpose3d_emulation_matches_the_reference():
    """scripts/emulate_conv_transpose3d.py: conv_transpose3d_s2k3's index math (runs of
    tiles, halo, swizzled staging, classes and taps, the sums, output positions and paired
    stores; for an NCDHW x the ring of input planes, the lanes' fragment loads and their
    banks) and its wgmma weight descriptor, emulated in NumPy against the float64
    definitions."""
    res = subprocess.run([sys.executable, str(SCRIPTS / "emulate_conv_transpose3d.py")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(": max error ") == 9 and res.stdout.count(": ok") == 2, res.stdout


def test_nonfinite_fuzz_of_the_numpy_path_matches_torch():
    """scripts/fuzz_pipelines.py --nonfinite --cpu: NaN / inf planted in random arguments of
    random shapes and options; the NumPy path puts them where PyTorch float64 does."""
    pytest.importorskip("torch")
    res = subprocess.run([sys.executable, str(SCRIPTS / "fuzz_pipelines.py"), "--nonfinite",
                          "--cpu", "--seconds", "10", "--seed", "7"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    ran = re.search(r"cases run: \{'A': (\d+), 'B': (\d+), 'C': (\d+)\}; failed: 0", res.stdout)
    assert ran and min(map(int, ran.groups())) >= 20, res.stdout


def test_fuzz_leaves_out_groupnorm_means_that_rounding_decides():
    """fuzz_pipelines leaves out the channels of an infinite GroupNorm weight in a group of
    exact mean 0 (pipeline B: +1 and -1 after tanh saturates under infinite BatchNorm
    biases), whose PyTorch value its rounding of the mean decides: NaN with 4 + 4 such
    values a group, +inf with 25 + 25, the NumPy path's NaN either way; the other channels
    still count, and a finite weight leaves nothing out."""
    pytest.importorskip("torch")
    import numpy as np

    import cufused

    sys.path.insert(0, str(SCRIPTS))
    try:
        fuzz = importlib.import_module("fuzz_pipelines")
    finally:
        sys.path.remove(str(SCRIPTS))
    options = dict(num_groups=1, stride=1, padding=0, output_padding=0, groups=1,
                   conv_bias=None)
    for side, torch_value in ((2, np.nan), (5, np.inf)):
        rng = np.random.default_rng(side)
        # A 1 x 1 kernel: conv output side x side a channel, pooled to (side / 2)^2 values.
        x = rng.random((1, 1, 2 * side, 2 * side))
        args = [x, rng.standard_normal((1, 2, 1, 1)), np.ones(2), np.array([np.inf, -np.inf]),
                np.array([1.0, -np.inf]), np.zeros(2)]
        out = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*args, **options)
        ref = fuzz._torch_reference("B", args, options)
        np.testing.assert_equal(ref[0, 1], np.full((side, side), torch_value))
        assert np.isnan(out[0, 1]).all()
        ignore = fuzz._mean_decided_by_rounding("B", args, options, ref.shape)
        assert ignore[0, 1].all() and not ignore[0, 0].any()
        assert fuzz._placement_error(out, ref, ignore, floor=1e-3) < 1e-9
        args[4] = np.array([1.0, -2.0])
        assert fuzz._mean_decided_by_rounding("B", args, options, ref.shape) is None


def test_sanitize_counts_reports_per_kernel():
    """scripts/sanitize.py counts a compute-sanitizer log's reports per function (racecheck's
    and memcheck's formats, a device function inside a kernel), and tells cuDNN's, CuPy's and
    PyTorch's kernels from cufused's."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        sanitize = importlib.import_module("sanitize")
    finally:
        sys.path.remove(str(SCRIPTS))
    log = "\n".join([
        "========= COMPUTE-SANITIZER",
        "========= Error: Race reported between Read access at void group_norm_rows_cached"
        "<(int)1, (int)4, (bool)0>(const float *, float *, int)+0x660",
        "=========     and Write access at void group_norm_rows_cached<(int)1, (int)4, (bool)0>"
        "(const float *, float *, int)+0x7a0 [512 hazards]",
        "========= Error: Race reported between Write access at sm90_xmma_dgrad_kernel__5x_cudnn"
        "+0x7e90",
        "========= Invalid __global__ read of size 16 bytes",
        "=========     at pool_nd(const float *, float *)+0x1a0 in pooling.cu:88",
        "=========     by thread (3,0,0) in block (0,0,0)",
        "=========     Host Frame: cuLaunchKernel at libcuda.so",
        "========= Warp Illegal Address",
        "=========     at float block_reduce<float, Sum>(float, float *, float, Sum)+0x90",
        "=========     at void stats_finalize<(int)1>(const float *, int)+0x2c0",
        "========= Program hit cudaErrorInvalidValue on CUDA API call to cuGetProcAddress",
        "=========     Host Frame: at cupy_backends.cuda.api.driver.launchKernel(x)+0x2",
        "========= ERROR SUMMARY: 4 errors",
    ])
    counts = sanitize.reported_kernels(log)
    assert counts == {"group_norm_rows_cached": 1, "sm90_xmma_dgrad_kernel__5x_cudnn": 1,
                      "pool_nd": 1, "block_reduce": 1}
    assert [k for k in counts if sanitize.is_third_party(k)] == [
        "sm90_xmma_dgrad_kernel__5x_cudnn"]
    assert sanitize.is_third_party("cupy_copy__float32_float32")
    assert not sanitize.is_third_party("conv_transpose3d_s2k3")


@pytest.mark.parametrize("error,status", [(0.0, 0), (1.0, 1)])
def test_halo_store_cases_dispatches_every_case(monkeypatch, capsys, error, status):
    """scripts/halo_store_cases.py runs each case through the case function it carries (the
    convolutions', the pool's and the class groups'), names the kernel each launched, counts
    the failures and sets the exit status: its three case functions stand in for the GPU."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        cases = importlib.import_module("halo_store_cases")
    finally:
        sys.path.remove(str(SCRIPTS))
    from cufused._kernels import conv_gemm

    # main() replaces both; monkeypatch puts the originals back.
    monkeypatch.setattr(conv_gemm, "sm_count", conv_gemm.sm_count)
    monkeypatch.setattr(conv_gemm, "get_kernel", lambda filename, name, **kw: None)

    def case_of(kind):
        def run(module, *args, **kwargs):
            module.get_kernel("conv_gemm.cu", kind)
            return error
        return run

    monkeypatch.setattr(cases, "_conv_case", case_of("conv"))
    monkeypatch.setattr(cases, "_pool_case", case_of("pool"))
    monkeypatch.setattr(cases, "_groups_case", case_of("groups"))
    assert cases.main([]) == status
    lines = capsys.readouterr().out.splitlines()
    verdict = "FAIL" if status else "ok"
    runs = 2 * len(cases.CONV_CASES) + 2 + 2
    assert sum(line.startswith(f"{verdict} conv: ") for line in lines) == 2 * len(cases.CONV_CASES)
    assert sum(line == f"{verdict} pool: pool 4, error {error:.1e}" for line in lines) == 2
    assert f"{verdict} groups: class groups, error {error:.1e}" in lines
    assert f"{verdict} groups: class groups, softmax sums, error {error:.1e}" in lines
    assert lines[-1] == f"cases run: {runs}; failed: {runs if status else 0}"


@pytest.mark.parametrize("path", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_script_parses(path):
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_every_mentioned_script_exists():
    """README, docs, scripts, tests, the asv suite and the library's comments name only
    scripts that exist."""
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.rst"), *SCRIPTS.iterdir(),
             *(ROOT / "tests").rglob("*.py"), *(ROOT / "asv_bench" / "benchmarks").glob("*.py"),
             *(ROOT / "cufused").rglob("*.py"), *(ROOT / "cufused" / "_cuda").glob("*.cu*")]
    pattern = re.compile(r"scripts/([\w-]+\.(?:py|sh))\b")
    mentioned = {(f.relative_to(ROOT), name) for f in files if f.is_file()
                 for name in pattern.findall(f.read_text(encoding="utf-8"))}
    assert any(name == "profile_pipelines.py" for _, name in mentioned)  # the scan finds them
    missing = sorted((str(f), name) for f, name in mentioned if not (SCRIPTS / name).exists())
    assert not missing, missing


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU")
def test_required_gpu_fails_the_run_without_one(tmp_path):
    # gpu_check.sh sets CUFUSED_REQUIRE_GPU=1: without a device the GPU tests do not skip,
    # the run stops with a usage error (pytest's status 4).
    import os

    (tmp_path / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    env = {**os.environ, "CUFUSED_REQUIRE_GPU": "1"}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
            "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"),
            "--confcutdir", str(ROOT / "tests"), str(ROOT / "tests" / "conftest.py"),
            str(tmp_path / "test_one.py")]
    required = subprocess.run(args, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert required.returncode == 4, required.stdout + required.stderr
    assert "CuPy sees no CUDA device" in required.stdout + required.stderr
    env["CUFUSED_REQUIRE_GPU"] = "0"
    free = subprocess.run(args, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert free.returncode == 0, free.stdout + free.stderr


def _compare_trees():
    spec = importlib.util.spec_from_file_location("compare_trees", SCRIPTS / "compare_trees.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_trees_times_only_the_trees_given(tmp_path, monkeypatch, capsys):
    # A tree without cufused/ is refused before any timing; a timing process that imported
    # another copy of cufused (an installed one, or a tree further on PYTHONPATH) stops the
    # comparison, since its figures would be that copy's.
    trees = _compare_trees()
    with pytest.raises(SystemExit) as refused:
        trees.main([str(tmp_path)])
    assert refused.value.code == 2 and "holds no cufused/" in capsys.readouterr().err
    tree = tmp_path / "old"
    (tree / "cufused").mkdir(parents=True)
    (tree / "cufused" / "__init__.py").write_text("")
    elsewhere = str(ROOT / "cufused" / "__init__.py")
    def child(file):
        row = dict(case="A", precision="tf32", ms=1.0, host_us=1.0, file=str(file))
        return lambda *a, **k: subprocess.CompletedProcess(a, 0, json.dumps(row) + "\n", "")

    args = trees.argparse.Namespace(repeat=1, cases=["A"], precisions=["tf32"],
                                    without_out=False)
    monkeypatch.setattr(trees.subprocess, "run", child(elsewhere))
    with pytest.raises(SystemExit, match="not the tree's"):
        trees._run_tree(str(tree), args)
    monkeypatch.setattr(trees.subprocess, "run", child(tree / "cufused" / "__init__.py"))
    assert trees._run_tree(str(tree), args)[0]["ms"] == 1.0
