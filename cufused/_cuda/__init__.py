"""CUDA sources of cufused and the helper that compiles and caches them.

Each ``.cu`` file is one op family; ``KERNELS`` lists every template instantiation the
library launches. At run time each instantiation is compiled on its first launch (per
device); CI compiles every one of them, for sm_80, sm_90 and the architecture-specific
targets of ``ARCH_TARGETS``, and checks that none spills to local memory.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import importlib.resources
import os
import re
import tempfile
import threading
import warnings

from .._scoped import scoped_value

# Template arguments that select a behaviour name the sources' #define codes (ACT_*, MODE_*,
# EPILOGUE_*): NVRTC expands them in name expressions, so their values live only in the .cu
# files. The launchers (cufused/_kernels/) ask for exactly these strings.
KERNELS: dict[str, tuple[str, ...]] = {
    "conv_gemm.cu": (
        "conv2d_igemm<1>",
        "conv2d_igemm<3>",
        "conv2d_halo<1, 0, 1>",
        "conv2d_halo<3, 0, 1>",
        "conv2d_halo<1, 3, 1>",
        "conv2d_halo<3, 3, 1>",
        "conv2d_halo<1, 0, 2>",
        "conv2d_halo<3, 0, 2>",
        "conv2d_halo<1, 3, 2>",
        "conv2d_halo<3, 3, 2>",
        "conv2d_halo_bands",
        "conv2d_halo_nhwc<1, 0, NHWC_THREADS>",
        "conv2d_halo_nhwc<1, 0, NHWC_TENSOR>",
        "conv2d_halo_nhwc<3, 0, NHWC_THREADS>",
        "conv2d_halo_nhwc<3, 0, NHWC_TENSOR>",
        "conv2d_halo_nhwc<1, 3, NHWC_THREADS>",
        "conv2d_halo_nhwc<1, 3, NHWC_TENSOR>",
        "conv2d_halo_nhwc<3, 3, NHWC_THREADS>",
        "conv2d_halo_nhwc<3, 3, NHWC_TENSOR>",
        "conv2d_halo_nhwc_direct<3, 3>",
        "conv2d_nhwc_held_weights",
        "conv2d_halo_pool_stats<1, 0, 2>",
        "conv2d_halo_pool_stats<3, 0, 2>",
        "conv2d_halo_pool_stats<1, 0, 4>",
        "conv2d_halo_pool_stats<3, 0, 4>",
        "conv2d_halo_pool_stats<1, 3, 2>",
        "conv2d_halo_pool_stats<3, 3, 2>",
        "conv2d_halo_pool_stats<1, 3, 4>",
        "conv2d_halo_pool_stats<3, 3, 4>",
        "conv2d_held_weights_pool_stats",
        "conv_transpose3d_s2k3<1, CT3_SOFTMAX_SUMS, false>",
        "conv_transpose3d_s2k3<3, CT3_SOFTMAX_SUMS, false>",
        "conv_transpose3d_s2k3<1, CT3_SOFTMAX, false>",
        "conv_transpose3d_s2k3<3, CT3_SOFTMAX, false>",
        "conv_transpose3d_s2k3<1, CT3_CONV, false>",
        "conv_transpose3d_s2k3<1, CT3_CONV, true>",
        "conv_transpose3d_s2k3<3, CT3_CONV, false>",
        "conv_transpose3d_s2k3_groups",
        "conv_transpose3d_s2k3_groups_softmax_sums",
        "conv_nonfinite_weight_rows<ForwardConvDefinition>",
        "conv_nonfinite_weight_rows<TransposedConvDefinition>",
        "conv_nonfinite_input_scan",
        "conv_nonfinite_input_samples<ForwardConvDefinition>",
        "conv_nonfinite_input_samples<TransposedConvDefinition>",
    ),
    "fft_conv.cu": (
        "fft_conv_scan",
        "fft_conv_plane_bins",
        "fft_conv_output_planes",
        "fft_conv_output_tables",
        "fft_conv_output_planes_mma",
    ),
    "pooling.cu": (
        "pool_nd<true, 0, 0>",
        "pool_nd<false, 0, 0>",
        "pool_nd<true, 1, 2>",
        "pool_nd<false, 1, 2>",
        "pool_nd<true, 2, 2>",
        "pool_nd<false, 2, 2>",
        "pool2_to_channels_last<true, 1>",
        "pool2_to_channels_last<false, 1>",
        "pool2_to_channels_last<true, 2>",
        "pool2_to_channels_last<false, 2>",
        "pool_extremum_stats<false, 0, false>",
        "pool_extremum_stats<false, 2, false>",
        "pool_extremum_stats<false, 2, true>",
        "pool_extremum_stats<false, 4, false>",
        "pool_extremum_stats<false, 4, true>",
        "pool_extremum_stats<true, 0, false>",
        "pool_extremum_stats<true, 2, false>",
        "pool_extremum_stats<true, 4, false>",
        "pool_extremum_stats_nchw_bands<2>",
        "pool_extremum_stats_nchw_bands<4>",
        "pool_extremum_stats_nhwc4<2, false>",
        "pool_extremum_stats_nhwc4<2, true>",
        "pool_extremum_stats_nhwc4<4, false>",
        "pool_extremum_stats_nhwc_rows<2, 1, false>",
        "pool_extremum_stats_nhwc_rows<2, 2, false>",
        "pool_extremum_stats_nhwc_rows<4, 1, false>",
        "pool_extremum_stats_nhwc_rows<4, 2, false>",
        "pool_extremum_stats_nhwc_rows<4, 1, true>",
        "pool_extremum_stats_nhwc_rows<4, 2, true>",
        "pool_affine_nonfinite",
        "pool_affine_nonfinite_conv",
        "pool_bn_tanh_nonfinite",
    ),
    "layout.cu": (
        "transpose_batched<EPILOGUE_NONE, 1>",
        "transpose_batched<EPILOGUE_NONE, 2>",
        "transpose_batched<EPILOGUE_NONE, 4>",
        "transpose_batched<EPILOGUE_BIAS, 1>",
        "transpose_batched<EPILOGUE_BIAS, 2>",
        "transpose_batched<EPILOGUE_BIAS, 4>",
        "transpose_batched<EPILOGUE_AFFINE_CLAMP, 1>",
        "transpose_batched<EPILOGUE_AFFINE_CLAMP, 2>",
        "transpose_batched<EPILOGUE_AFFINE_CLAMP, 4>",
        "transpose_channels8<true>",
        "transpose_channels8<false>",
        "add_channel_bias<1>",
        "add_channel_bias<4>",
        "subpixel_interleave<1, 1>",
        "subpixel_interleave<1, 4>",
        "subpixel_interleave<2, 1>",
        "subpixel_interleave<2, 4>",
    ),
    "normalization.cu": (
        "key_stats_partial",
        "stats_finalize<MODE_GROUP_NORM>",
        "stats_finalize<MODE_BATCH_NORM>",
        "channel_affine<ACT_NONE, 1>",
        "channel_affine<ACT_NONE, 4>",
        "channel_affine<ACT_TANH, 1>",
        "channel_affine<ACT_TANH, 4>",
        "channel_affine<ACT_CLAMP, 1>",
        "channel_affine<ACT_CLAMP, 4>",
        "group_affine_rows<ACT_CLAMP, 1>",
        "group_affine_rows<ACT_CLAMP, 4>",
        "group_norm_rows<ACT_NONE, true, 1>",
        "group_norm_rows<ACT_NONE, true, 4>",
        "group_norm_rows<ACT_TANH, true, 1>",
        "group_norm_rows<ACT_TANH, true, 4>",
        "group_norm_rows<ACT_TANH, false, 1>",
        "group_norm_rows<ACT_TANH, false, 4>",
        "group_norm_rows_cached<ACT_NONE, 1, false>",
        "group_norm_rows_cached<ACT_NONE, 4, false>",
        "group_norm_rows_cached<ACT_TANH, 1, false>",
        "group_norm_rows_cached<ACT_TANH, 4, false>",
        "group_norm_rows_cached<ACT_NONE, 1, true>",
        "group_norm_rows_cached<ACT_NONE, 4, true>",
        "group_norm_rows_cached<ACT_TANH, 1, true>",
        "group_norm_rows_cached<ACT_TANH, 4, true>",
    ),
    "softmax.cu": (
        "softmax_stats<false, true, false>",
        "softmax_stats<false, true, true>",
        "softmax_stats<false, false, true>",
        "softmax_stats<true, true, true>",
        "softmax_stats<true, false, true>",
        "softmax_stats_nhwc4<true, true>",
        "softmax_stats_nhwc4<false, true>",
        "softmax_finalize",
        "softmax_apply<false, 1>",
        "softmax_apply<false, 4>",
        "softmax_apply<true, 1>",
        "softmax_apply<true, 4>",
        "softmax_apply_transpose<true, 1>",
        "softmax_apply_transpose<true, 4>",
        "softmax_apply_subpixel<true, 1, 1>",
        "softmax_apply_subpixel<true, 1, 4>",
        "softmax_apply_subpixel<true, 2, 1>",
        "softmax_apply_subpixel<true, 2, 4>",
        "softmax_rows_cluster<1, 1, 1>",
        "softmax_rows_cluster<1, 1, 2>",
        "softmax_rows_cluster<1, 2, 1>",
        "softmax_rows_cluster<1, 2, 2>",
        "softmax_rows_cluster<2, 1, 1>",
        "softmax_rows_cluster<2, 1, 2>",
        "softmax_rows_cluster<2, 2, 1>",
        "softmax_rows_cluster<2, 2, 2>",
        "softmax_rows_nonfinite_weight",
    ),
}

# Keep float32 math IEEE-accurate (no fast-math): the kernels are bandwidth-bound.
COMPILE_OPTIONS = ("-std=c++17",)
# What CuPy's RawModule adds to them (denormals flushed, unannotated functions on the
# device): kernels that NVRTC compiles here directly are built as those CuPy compiles.
_CUPY_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")
# Sources with a path of one architecture's own instructions (conv_gemm.cu: Hopper's
# warpgroup MMA), by the compute capability whose feature target ("sm_90a") they are
# compiled for there; such a cubin runs on that architecture only. CuPy compiles for the
# portable targets only, so these go through NVRTC here.
ARCH_TARGETS: dict[str, dict[str, str]] = {"conv_gemm.cu": {"90": "sm_90a"}}

_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.MULTILINE)


@functools.cache
def source(filename: str) -> str:
    """Return a kernel file's text with its local ``#include "..."`` lines inlined."""
    text = importlib.resources.files(__name__).joinpath(filename).read_text(encoding="utf-8")
    return _INCLUDE.sub(lambda m: source(m.group(1)), text)


def _nvrtc_compile(filename: str, names, arch: str, extra=()) -> tuple[str, bytes, dict]:
    """NVRTC's log, the cubin and the lowered names of ``names`` (name expressions of
    ``filename``) compiled together for ``arch``; RuntimeError with the log if NVRTC rejects
    the source."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source(filename), filename, [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, [*COMPILE_OPTIONS, *_CUPY_OPTIONS,
                                        f"--gpu-architecture={arch}", *extra])
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"{filename} ({arch}): {exc}\n{nvrtc.getProgramLog(prog)}") from exc
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in names}
        return nvrtc.getProgramLog(prog), nvrtc.getCUBIN(prog), lowered
    finally:
        nvrtc.destroyProgram(prog)


def _arch_cubin(filename: str, name: str, arch: str) -> tuple[bytes, str]:
    """The cubin and the lowered name of one instantiation built for ``arch``: from the
    directory where CuPy keeps its compiled kernels (``CUPY_CACHE_DIR``, else
    ``~/.cupy/kernel_cache``), or compiled and stored there, so that a cold process pays
    NVRTC once per machine, as for the kernels CuPy builds. An entry is the lowered name and
    the cubin's SHA-256 on a first line, then the cubin; one that fails the check is
    rebuilt. With ``CUPY_CACHE_IN_MEMORY`` set, or a directory that cannot be written, each
    process compiles. (CuPy's ``getCUBIN`` leaves out the ELF's trailing zero byte, as for
    CuPy's own cache: a ``bytes`` object ends in one, which the loader reads.)"""
    from cupy_backends.cuda.libs import nvrtc

    if os.environ.get("CUPY_CACHE_IN_MEMORY", "0") not in ("", "0"):
        _, cubin, names = _nvrtc_compile(filename, (name,), arch)
        return cubin, names[name]
    key = hashlib.sha256("\0".join((source(filename), name, arch, *COMPILE_OPTIONS,
                                     *_CUPY_OPTIONS, repr(nvrtc.getVersion()))).encode())
    directory = os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))
    path = os.path.join(directory, f"cufused_{arch}_{key.hexdigest()}.cubin")

    def digest(lowered: str, cubin: bytes) -> str:
        return hashlib.sha256(lowered.encode() + b"\0" + cubin).hexdigest()

    try:
        with open(path, "rb") as fh:
            header, _, cubin = fh.read().partition(b"\n")
        lowered, _, checksum = header.decode().partition(" ")
        if digest(lowered, cubin) == checksum:
            return cubin, lowered
    except (OSError, UnicodeDecodeError):
        pass
    _, cubin, names = _nvrtc_compile(filename, (name,), arch)
    lowered = names[name]
    temporary = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=directory, prefix="cufused_")
        with os.fdopen(fd, "wb") as fh:
            fh.write(f"{lowered} {digest(lowered, cubin)}\n".encode() + cubin)
        os.replace(temporary, path)  # readers see the whole entry or none
    except OSError:
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)
    return cubin, lowered


class _CubinKernel:
    """A kernel that NVRTC compiled here (an architecture-specific target), launched and
    granted shared memory as a ``cupy.RawKernel`` is."""

    def __init__(self, filename: str, name: str, arch: str):
        import cupy

        cubin, lowered = _arch_cubin(filename, name, arch)
        module = cupy.cuda.function.Module()
        module.load(cubin)
        self._function = module.get_function(lowered)  # keeps the module

    def __call__(self, grid, block, args, *, shared_mem: int = 0) -> None:
        self._function(grid, block, args, shared_mem=shared_mem)

    @property
    def shared_size_bytes(self) -> int:
        import cupy

        return cupy.cuda.driver.funcGetAttribute(
            cupy.cuda.driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, self._function.ptr)

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        import cupy

        return cupy.cuda.driver.funcGetAttribute(
            cupy.cuda.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            self._function.ptr)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        import cupy

        cupy.cuda.driver.funcSetAttribute(
            self._function.ptr, cupy.cuda.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            value)


# True inside portable_builds(): kernels of ARCH_TARGETS built for the portable target.
_portable = contextvars.ContextVar("cufused_portable_builds", default=False)


@contextlib.contextmanager
def portable_builds():
    """Launch the kernels of ``ARCH_TARGETS`` as built for the device's portable target
    (CuPy's) inside this context, so that tests on such a device also run the path every
    other architecture takes. Convolution plans and whole-call graphs captured with the
    other build replay it: callers clear them (:func:`cufused.clear_caches`) around."""
    with scoped_value(_portable, True):
        yield


@functools.cache
def _arch_target(filename: str, device: int) -> str | None:
    import cupy

    return ARCH_TARGETS.get(filename, {}).get(cupy.cuda.Device(device).compute_capability)


# (source, device) pairs whose build for the architecture's own target failed there (an
# NVRTC without the target): their kernels take the portable build from then on.
_arch_failed: set[tuple[str, int]] = set()


def _build_target(filename: str, device: int, portable: bool) -> str | None:
    """The target ``filename``'s kernels are built for on ``device``: None (the portable
    build) where ``portable``, where the device has no target of its own, or once a build
    for that target failed there."""
    if portable or (filename, device) in _arch_failed:
        return None
    return _arch_target(filename, device)


def arch_target(filename: str) -> str | None:
    """The architecture's own target (``ARCH_TARGETS``) that :func:`get_kernel` builds
    ``filename``'s kernels for on the current device, or None: the portable build (no such
    target there, inside :func:`portable_builds`, or once a build for the target failed on
    the device: NVRTC lacks it)."""
    import cupy

    return _build_target(filename, cupy.cuda.runtime.getDevice(), _portable.get())


def _build(filename: str, name: str, device: int, portable: bool):
    import cupy

    arch = _build_target(filename, device, portable)
    if arch is not None:
        try:
            return _CubinKernel(filename, name, arch)
        except RuntimeError as exc:  # an NVRTC without the target: the portable build
            _arch_failed.add((filename, device))
            warnings.warn(f"cufused: {name} not built for {arch}, so built for the portable "
                          f"target: {str(exc).splitlines()[0]}", RuntimeWarning, stacklevel=3)
    return cupy.RawModule(code=source(filename), options=COMPILE_OPTIONS,
                          name_expressions=(name,)).get_function(name)


# Compiled kernels by (device, file, name expression, portable). Each instantiation is its
# own NVRTC program: a call compiles only the kernels it launches (a cold process pays for
# what it uses, not for a whole file's templates), and the lookup of a warm kernel is one
# dict access.
_kernels: dict[tuple[int, str, str, bool], object] = {}
# Dynamic shared memory that a launch gets without a grant, by the key of _kernels: 48 KB
# less the kernel's static shared memory (a launch past it fails), queried once per kernel.
_shared_default: dict[tuple[int, str, str, bool], int] = {}
# Dynamic shared memory granted past that default, by the key of _kernels: the attribute
# belongs to the compiled function, so it is set once, not queried per launch.
_shared_granted: dict[tuple[int, str, str, bool], int] = {}
_lock = threading.Lock()


def get_kernel(filename: str, name: str, *, shared_bytes: int = 0):
    """Return the kernel for ``name`` (a name expression of ``KERNELS[filename]``) on the
    current device, allowed ``shared_bytes`` of dynamic shared memory where that and the
    kernel's static shared memory pass the default 48 KB: a ``cupy.RawKernel``, or for a
    source of ``ARCH_TARGETS`` on its architecture one built for that architecture's own
    target, launched the same way."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    key = (device, filename, name, filename in ARCH_TARGETS and _portable.get())
    kernel = _kernels.get(key)
    if kernel is None:
        if name not in KERNELS[filename]:
            raise KeyError(f"{name} is not a registered instantiation of {filename}")
        with _lock:
            kernel = _kernels.get(key)
            if kernel is None:
                kernel = _build(filename, name, device, key[3])
                _shared_default[key] = 48 * 1024 - kernel.shared_size_bytes
                _kernels[key] = kernel
    if (shared_bytes and shared_bytes > _shared_default[key]
            and _shared_granted.get(key, 0) < shared_bytes):
        with _lock:  # two threads must not leave the smaller grant in place
            if _shared_granted.get(key, 0) < shared_bytes:
                kernel.max_dynamic_shared_size_bytes = shared_bytes
                _shared_granted[key] = shared_bytes
    return kernel


def compile_offline(filename: str, arch: str) -> dict[str, str]:
    """Compile every registered instantiation of ``filename`` to a cubin with NVRTC, no GPU needed.

    Parameters
    ----------
    filename : str
        A key of ``KERNELS``.
    arch : str
        Target such as ``"sm_80"`` or ``"sm_90"``.

    Returns
    -------
    dict
        ``{"log": ptxas log, "cubin_bytes": size}``; the log holds the register and spill report.

    Raises
    ------
    RuntimeError
        If NVRTC rejects the source; the message holds its log.
    """
    log, cubin, _ = _nvrtc_compile(filename, KERNELS[filename], arch, ("-Xptxas=-v",))
    return {"log": log, "cubin_bytes": str(len(cubin))}


class TensorMap:
    """A kernel argument passed by value: a tiled tensor map of the tensor memory accelerator
    (the driver's 128-byte ``CUtensorMap``), as the ``__grid_constant__`` struct of its size
    that the kernel declares. All zeros where no map could be built (the kernel then copies
    by other means)."""

    BYTES = 128

    def __init__(self) -> None:
        import numpy

        # The driver writes the map to a 64-byte aligned address.
        self._raw = numpy.zeros(self.BYTES // 8 + 8, dtype=numpy.uint64)
        start = (-self._raw.ctypes.data % 64) // 8
        self.words = self._raw[start:start + self.BYTES // 8]

    @property
    def address(self) -> int:
        """The host address of the map's bytes."""
        return self.words.ctypes.data

    def as_argument(self):
        """The argument CuPy's launch passes: a pointer to the bytes, copied at the launch
        (or into the graph node when captured)."""
        from cupy.cuda.function import CPointer

        return CPointer(self.address)


@functools.cache
def _encode_tiled():
    """The driver's ``cuTensorMapEncodeTiled``, or None (no driver library, or one without the
    tensor memory accelerator's entry point)."""
    import ctypes

    try:
        fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return fn


_TENSOR_MAP_FLOAT32, _SWIZZLE_NONE, _SWIZZLE_128B, _L2_PROMOTION_128B = 7, 0, 3, 2


@functools.lru_cache(maxsize=64)
def float32_tensor_map(address: int, dims: tuple[int, ...], strides: tuple[int, ...],
                       box: tuple[int, ...], *, swizzle: bool = True) -> TensorMap | None:
    """A tiled tensor map of float32 values at device ``address``: ``dims`` innermost first,
    ``strides`` the bytes between consecutive indices of each dimension after the first
    (multiples of 16), ``box`` the elements one copy moves per dimension. With ``swizzle``
    the box's first dimension is 128 bytes and the copy applies the 128-byte swizzle (the
    16-byte chunks of a 128-byte row XORed with the row's index modulo 8, from a 1024-byte
    aligned destination); without, the box arrives dense, its first dimension a multiple of
    16 bytes. Elements outside ``dims`` arrive as zeros. None where the driver offers no such
    map or refuses this one. Cached per (address, geometry): the map holds nothing else."""
    import ctypes

    encode = _encode_tiled()
    if encode is None:
        return None
    rank = len(dims)
    tensor_map = TensorMap()
    status = encode(ctypes.c_void_p(tensor_map.address), _TENSOR_MAP_FLOAT32, rank,
                    ctypes.c_void_p(address), (ctypes.c_uint64 * rank)(*dims),
                    (ctypes.c_uint64 * (rank - 1))(*strides), (ctypes.c_uint32 * rank)(*box),
                    (ctypes.c_uint32 * rank)(*([1] * rank)), 0,
                    _SWIZZLE_128B if swizzle else _SWIZZLE_NONE, _L2_PROMOTION_128B, 0)
    return tensor_map if status == 0 else None


def optional(array):
    """A kernel argument for an optional array: the array, or a null pointer."""
    import numpy

    return numpy.uint64(0) if array is None else array


@functools.cache
def _sm_count(device: int) -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]


def sm_count() -> int:
    """Multiprocessors of the current device."""
    import cupy

    return _sm_count(cupy.cuda.runtime.getDevice())


@functools.cache
def _shared_per_block(device: int) -> int:
    import cupy

    return cupy.cuda.runtime.deviceGetAttribute(
        cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device)


def shared_per_block() -> int:
    """Bytes of shared memory a block of the current device may be granted (99 KB on
    compute capability 8.6, 8.9 and 12.0; 163 KB on 8.0, 227 KB on 9.0)."""
    import cupy

    return _shared_per_block(cupy.cuda.runtime.getDevice())


@functools.cache
def _shared_per_sm(device: int) -> tuple[int, int]:
    import cupy

    runtime = cupy.cuda.runtime
    return (runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerMultiprocessor,
                                       device),
            runtime.deviceGetAttribute(runtime.cudaDevAttrReservedSharedMemoryPerBlock, device))


def resident_blocks(shared_bytes: int) -> int:
    """Blocks of ``shared_bytes`` of dynamic shared memory each that one multiprocessor of the
    current device holds at once by their shared memory (each also takes the memory the
    system reserves a block: 1 KB from compute capability 8.0)."""
    import cupy

    per_sm, reserved = _shared_per_sm(cupy.cuda.runtime.getDevice())
    return per_sm // (shared_bytes + reserved)


# CUDA's handle of the per-thread default stream: the same value names another stream in each
# thread.
_PER_THREAD_STREAM = 2


def stream_key(stream):
    """What tells ``stream`` apart from the others in a cache key: its handle, and the thread
    for the per-thread default stream."""
    ptr = stream.ptr
    return ptr if ptr != _PER_THREAD_STREAM else (ptr, threading.get_ident())


# A device's synchronization is illegal while any of its streams is being captured, and it
# invalidates that capture; so is freeing device memory (cudaFree). cufused's own captures
# (each thread's) and the releases below exclude each other: a release asked for during a
# capture is queued, with what it holds, and done where the last capture in progress ends.
_release_state = threading.Condition()
_captures_under_way = 0
_releasing = False
# Queued releases: (devices, references, what runs after them or None), each done whole.
_queued: list = []


@contextlib.contextmanager
def own_capture_scope():
    """Around one of cufused's own graph captures: it starts once no release is under way,
    and the releases asked for meanwhile (:func:`release_after_devices`) are done at the end
    of the last capture in progress (their failure is not the capture's)."""
    global _captures_under_way
    with _release_state:
        while _releasing:
            _release_state.wait()
        _captures_under_way += 1
    try:
        yield
    finally:
        with _release_state:
            _captures_under_way -= 1
        with contextlib.suppress(Exception):  # left queued for the next release
            _release_queued()


def release_after_devices(devices, held: list, *, stream=None, then=None) -> None:
    """Let go of the references in ``held`` (emptied) once each device (id) in ``devices``
    has done its queued work, then call ``then()`` (a pool's ``free_all_blocks``): the memory
    that the work may still read would otherwise go back to a pool, where another stream
    would reuse it, or to the device. Where one of cufused's captures is under way (in any
    thread), or ``stream`` (the caller's current one, when it may be captured) is being
    captured, the release is queued and done by a later call here or the end of the last
    capture; the queue waits while such a stream is captured."""
    refs = list(held)
    held.clear()
    with _release_state:
        _queued.append((frozenset(devices), refs, then, stream))
    refs = None  # the queue holds them alone: they go where it drops them
    _release_queued()


def _release_queued() -> None:
    """Do the queued releases, unless a capture or another release is under way (which then
    does them), or a stream that a queued release names is being captured. A release whose
    device fails to synchronize stays queued (the error is raised after the others are
    done)."""
    global _releasing
    import cupy

    while True:
        with _release_state:
            if _releasing or _captures_under_way or not _queued:
                return
            if any(entry[3] is not None and capturing(entry[3]) for entry in _queued):
                return
            _releasing = True
        errors = []
        try:
            with _release_state:
                pending = _queued[:]
            failed = set()
            for device in set().union(*(entry[0] for entry in pending)):
                try:
                    cupy.cuda.Device(device).synchronize()
                except Exception as exc:  # noqa: BLE001 - raised below, the rest done first
                    failed.add(device)
                    errors.append(exc)
            done = [entry for entry in pending if not entry[0] & failed]
            with _release_state:  # entries queued meanwhile, and the failed ones, stay
                _queued[:] = [e for e in _queued if not any(e is d for d in done)]
            then = [entry[2] for entry in done if entry[2] is not None]
            for entry in done:
                entry[1].clear()  # what they free (a graph's own pool: cudaFree) goes here
            for action in then:
                try:
                    action()
                except Exception as exc:  # noqa: BLE001 - raised below, the rest run first
                    errors.append(exc)
        finally:
            with _release_state:
                _releasing = False
                _release_state.notify_all()
        if errors:
            raise errors[0]


def capturing(stream) -> bool:
    """Whether ``stream`` is being captured into a CUDA graph. The query itself is illegal
    during some global captures (cudaErrorStreamCaptureImplicit): then it is."""
    try:
        return stream.is_capturing()
    except Exception:  # noqa: BLE001 - the error type depends on the CuPy version
        return True


#: Blocks that a grid's x dimension takes, and its y or z dimension.
MAX_GRID_X, MAX_GRID_YZ = 2**31 - 1, 65535


def fits_grid_yz(items: int, per_block: int) -> bool:
    """Whether ``items`` tiled ``per_block`` to a block fit a grid's y or z dimension."""
    return -(-items // per_block) <= MAX_GRID_YZ


def launch_1d(kernel, total: int, args: tuple) -> None:
    """Launch a grid-stride kernel over ``total`` items in blocks of 256 threads (enough
    blocks to fill the device)."""
    if total <= 0:
        return
    grid = min(-(-total // 256), sm_count() * 32)
    kernel((grid,), (256,), args)
