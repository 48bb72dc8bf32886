"""Every CUDA kernel instantiation compiles with NVRTC for sm_80, sm_90 and its source's
architecture-specific targets (sm_90a for the wgmma path), without spills or stack frames.

Runs without a GPU: NVRTC only needs CuPy's bindings and the NVRTC library.
"""

from __future__ import annotations

import re

import pytest

from cufused._cuda import ARCH_TARGETS, KERNELS, source

nvrtc_missing = None
try:
    from cupy_backends.cuda.libs import nvrtc

    nvrtc.getVersion()
except Exception as exc:  # noqa: BLE001 - no CuPy or no NVRTC library
    nvrtc_missing = str(exc)


# Every file for sm_80 and sm_90, and those of ARCH_TARGETS for their own targets too.
TARGETS = [(filename, arch) for filename in sorted(KERNELS) for arch in (
    "sm_80", "sm_90", *sorted(ARCH_TARGETS.get(filename, {}).values()))]


@pytest.mark.skipif(nvrtc_missing is not None, reason=f"NVRTC unavailable: {nvrtc_missing}")
@pytest.mark.parametrize("filename, arch", TARGETS)
def test_kernels_compile_without_spills(filename, arch):
    from cufused._cuda import compile_offline

    result = compile_offline(filename, arch)
    log = result["log"]
    entries = re.findall(r"Compiling entry function '(\w+)'", log)
    assert len(entries) >= len(KERNELS[filename]), log
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    assert spills and not any(spills), f"local-memory spills in {filename} ({arch}):\n{log}"
    # A stack frame without spills is a dynamically indexed local array: local memory too
    # (group_norm_rows once lost 25 % to two 2-element arrays indexed by a run-time bool).
    frames = [int(v) for v in re.findall(r"(\d+) bytes stack frame", log)]
    assert frames and not any(frames), f"stack frames in {filename} ({arch}):\n{log}"
    assert int(result["cubin_bytes"]) > 0


def test_sources_ship_with_the_package():
    for filename in KERNELS:
        text = source(filename)
        assert "#include \"" not in text  # local includes are inlined
        for name in KERNELS[filename]:
            assert name.split("<")[0] in text


def test_every_launched_kernel_is_registered():
    # Every kernel name that the launchers (cufused/_kernels/, the only modules that launch:
    # tests/internals/launchers/test_launchers.py) spell out must be a registered
    # instantiation (the set CI compiles); f-string names are checked by their prefix.
    import pathlib

    registered = {n for names in KERNELS.values() for n in names}
    launchers = pathlib.Path(__file__).resolve().parents[3] / "cufused" / "_kernels"
    names = []
    for path in launchers.glob("*.py"):
        text = path.read_text()
        names += re.findall(r'get_kernel\([^,]+,\s*f?"([^"]+)"', text)
        names += re.findall(r'f?"(\w+<[^"]*>?)"', text)  # names built before the call
    assert len(names) > 20
    for name in names:
        prefix = name.split("{")[0]
        assert any(r.startswith(prefix) for r in registered), name


def test_arch_builds_are_cached_on_disk(tmp_path, monkeypatch):
    # An architecture-specific build is compiled once per machine: the second process (here,
    # the second call) reads the entry; an entry that fails its checksum is rebuilt.
    import cufused._cuda as cuda

    compiled = []

    def fake_compile(filename, names, arch, extra=()):
        compiled.append((filename, tuple(names), arch))
        return "log", b"\x7fELF cubin \n with a newline", {names[0]: "_Z5lowered"}

    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cuda, "_nvrtc_compile", fake_compile)
    if nvrtc_missing is not None:  # the key takes NVRTC's version
        pytest.skip(f"NVRTC unavailable: {nvrtc_missing}")
    first = cuda._arch_cubin("conv_gemm.cu", "conv2d_halo<1, 3, 2>", "sm_90a")
    second = cuda._arch_cubin("conv_gemm.cu", "conv2d_halo<1, 3, 2>", "sm_90a")
    assert first == second == (b"\x7fELF cubin \n with a newline", "_Z5lowered")
    assert len(compiled) == 1
    (entry,) = (tmp_path / "cache").iterdir()
    entry.write_bytes(entry.read_bytes()[:-1] + b"?")
    assert cuda._arch_cubin("conv_gemm.cu", "conv2d_halo<1, 3, 2>", "sm_90a") == first
    assert len(compiled) == 2
    entry.write_bytes(entry.read_bytes().replace(b"_Z5lowered", b"_Z5lowerex"))
    assert cuda._arch_cubin("conv_gemm.cu", "conv2d_halo<1, 3, 2>", "sm_90a") == first
    assert len(compiled) == 3
    cuda._arch_cubin("conv_gemm.cu", "conv2d_halo<3, 3, 2>", "sm_90a")  # another key
    assert len(compiled) == 4 and len(list((tmp_path / "cache").iterdir())) == 2
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")  # no disk: compiled every time
    cuda._arch_cubin("conv_gemm.cu", "conv2d_halo<3, 3, 2>", "sm_90a")
    assert len(compiled) == 5

