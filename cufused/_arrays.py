"""Array-module dispatch: NumPy arrays take the reference path, CuPy arrays the GPU path
(:func:`forward`, the skeleton every op and pipeline ends with).

CuPy is imported lazily so that ``import cufused`` works on machines without it.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
import os
import sys
from collections.abc import Callable
from typing import Any, Union

import numpy

from ._layout import stored_in
from ._scoped import scoped_value

#: An option given once for every spatial dimension, or once per dimension.
Size = Union[int, tuple[int, ...]]

_CUDA_EXTRA_HINT = (
    "the GPU path needs CuPy and cuDNN Frontend: install cufused[cuda12] or cufused[cuda13]"
)


def is_cupy_array(value: Any) -> bool:
    """True for a ``cupy.ndarray`` (checked without importing CuPy: before CuPy is imported,
    no CuPy array exists)."""
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(value, cupy.ndarray)


def other_device(args: tuple, kwargs: dict) -> int | None:
    """The CUDA device of a public call's CuPy ``x`` (its first argument) where that is not
    the current device, else None: the call then runs with that device current, so that its
    results, temporaries, streams and kernels are the array's device's."""
    cupy = sys.modules.get("cupy")
    x = args[0] if args else kwargs.get("x")
    if cupy is None or not isinstance(x, cupy.ndarray):
        return None
    device = x.data.device_id
    return None if device == cupy.cuda.runtime.getDevice() else device


def import_cupy():
    """Import CuPy or raise an ``ImportError`` that names the extra to install."""
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(_CUDA_EXTRA_HINT) from exc
    return cupy


# gpu_unavailable_reason's answers where no GPU installation is there to fail: CuPy not
# installed (the answer's start), and no driver or device.
_CUPY_NOT_INSTALLED, _NO_CUDA_GPU = "CuPy is not installed", "no CUDA GPU"


def no_gpu_installation(reason: str) -> bool:
    """Whether ``reason`` (:func:`gpu_unavailable_reason`'s) says that there is no GPU
    installation (no CuPy, or no driver or device), rather than one that does not work."""
    return reason == _NO_CUDA_GPU or reason.startswith(_CUPY_NOT_INSTALLED)


def gpu_unavailable_reason() -> str | None:
    """Why the GPU path cannot run here, or None when CuPy sees a CUDA device.

    The reasons a user acts on differently are told apart: CuPy not installed, installed but
    failing to import, no NVIDIA driver or no device ("no CUDA GPU"), a driver older than the
    CUDA that CuPy is built for, and any other error of the CUDA runtime.
    """
    try:
        import cupy

        runtime = cupy.cuda.runtime
    except ModuleNotFoundError as exc:
        if exc.name == "cupy":
            return f"{_CUPY_NOT_INSTALLED} ({_CUDA_EXTRA_HINT})"
        return f"CuPy is installed but cannot be imported ({_first_line(exc)})"
    except Exception as exc:  # noqa: BLE001 - a broken installation, of any kind
        return f"CuPy is installed but cannot be imported ({_first_line(exc)})"
    try:
        count = runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError, or a broken installation
        try:
            driver, built_for = runtime.driverGetVersion(), runtime.runtimeGetVersion()
        except Exception:  # noqa: BLE001 - the same broken installation
            driver = built_for = None
        status = getattr(exc, "status", None)
        if driver == 0 or status == _CUDA_ERROR_NO_DEVICE:
            return _NO_CUDA_GPU
        if (status == _CUDA_ERROR_INSUFFICIENT_DRIVER and driver is not None
                and driver < built_for):
            advice = "update the driver"
            if driver // 1000 < built_for // 1000:
                advice += (f", or replace CuPy by its build for CUDA {driver // 1000} (uninstall "
                           f"cupy-cuda{built_for // 1000}x, then install "
                           f"cufused[cuda{driver // 1000}])")
            return (f"the NVIDIA driver supports CUDA {_cuda_version(driver)}, older than the "
                    f"CUDA {_cuda_version(built_for)} CuPy is built for: {advice}")
        return f"CuPy cannot use a CUDA GPU ({type(exc).__name__}: {_first_line(exc)})"
    return None if count > 0 else _NO_CUDA_GPU


# The CUDA runtime's errors that gpu_unavailable_reason tells apart.
_CUDA_ERROR_INSUFFICIENT_DRIVER, _CUDA_ERROR_NO_DEVICE = 35, 100


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _cuda_version(number: int) -> str:
    """CUDA's encoded version (1000 * major + 10 * minor) as ``major.minor``."""
    return f"{number // 1000}.{number % 1000 // 10}"


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    return gpu_unavailable_reason() is None


def check_required(**arrays: Any) -> None:
    """Raise ``TypeError`` naming the first of these required arrays that is ``None``."""
    for name, value in arrays.items():
        if value is None:
            raise TypeError(f"{name} must be a numpy.ndarray or cupy.ndarray, got None")


def get_array_module(**arrays: Any):
    """Return ``numpy`` or ``cupy`` for the named arrays (``None`` values are skipped).

    Raises
    ------
    TypeError
        An argument is not an array, or NumPy and CuPy arrays are mixed.
    ValueError
        CuPy arrays live on different devices.
    """
    kind = None
    first = None
    device = None
    for name, value in arrays.items():
        if value is None:
            continue
        if isinstance(value, numpy.ndarray):
            if isinstance(value, numpy.ma.MaskedArray):
                raise TypeError(f"{name} is a masked array, whose mask cufused would ignore: "
                                f"pass {name}.filled(value) or its data")
            this = "numpy"
        elif is_cupy_array(value):
            this = "cupy"
        else:
            # A PyTorch tensor has operators of its own (by its class's module, without
            # importing torch).
            hint = ("; cufused.torch's operators and modules take torch tensors"
                    if type(value).__module__.split(".")[0] == "torch" else "")
            raise TypeError(f"{name} must be a numpy.ndarray or cupy.ndarray, got "
                            f"{type(value).__name__}{hint}")
        if kind is None:
            kind, first = this, name
        elif this != kind:
            raise TypeError(
                f"{name} is a {this} array but {first} is a {kind} array; "
                "pass all arrays from the same library"
            )
        if this == "cupy":
            dev = value.data.device_id  # cheaper than value.device.id (a new Device object)
            if device is None:
                device = dev
            elif dev != device:
                raise ValueError(
                    f"{name} is on CUDA device {dev} but {first} is on CUDA device {device}"
                )
    if kind == "cupy":
        return import_cupy()
    return numpy


def check_float_dtype(xp, **arrays: Any) -> None:
    """Check dtypes: float16/32/64 on the NumPy path, float32 on the GPU path."""
    allowed = ("float32",) if xp is not numpy else ("float16", "float32", "float64")
    sizes = (4,) if xp is not numpy else (2, 4, 8)
    for name, value in arrays.items():
        # kind and itemsize rather than the name: cheaper on every call, same dtypes
        if value is not None and (value.dtype.kind != "f" or value.dtype.itemsize not in sizes):
            raise TypeError(
                f"{name} has dtype {value.dtype.name}; supported here: {', '.join(allowed)}"
            )


def check_ndim(x: Any, name: str, ndim: int, layout: str, *, unbatched: bool = False) -> None:
    """Raise ``ValueError`` unless ``x.ndim`` is ``ndim``; its message names the ``layout``,
    and with ``unbatched`` also the layout without N (which the caller took before)."""
    if x.ndim != ndim:
        also = f" (or {layout[1:]}, unbatched, with ndim {ndim - 1})" if unbatched else ""
        raise ValueError(f"{name} must be {layout} with ndim {ndim}{also}, got shape {x.shape}")


def one_sample(run: Callable[..., Any], x: Any, out: Any) -> Any:
    """PyTorch's unbatched input, ``x`` without its batch axis: ``run(x[None],
    out=out[None])`` (``out`` as given where it is no array, for the checks to refuse it),
    which returns the batch of one; the result is ``out``, else that batch's sample. The
    batch axes have the stride of a packed batch, so that ``x`` and ``out`` keep their
    layouts; an error names the batch of one's shapes, and says so."""
    batch_out = out
    if isinstance(out, numpy.ndarray) or is_cupy_array(out):
        if out.ndim != x.ndim:
            raise ValueError(f"out must have the unbatched result's ndim {x.ndim} (x has "
                             f"shape {x.shape}), got shape {out.shape}")
        batch_out = _batch_of_one(out)
    try:
        result = run(_batch_of_one(x), out=batch_out)
    except (TypeError, ValueError) as err:
        if err.args and isinstance(err.args[0], str):
            err.args = (f"{err.args[0]} (x of shape {x.shape}, without a batch axis, runs as "
                        f"the batch of one x[None])", *err.args[1:])
        raise
    return out if out is not None else result[0]


def _batch_of_one(a: Any) -> Any:
    """``a`` as a batch of one: a view with a leading axis of extent 1 whose stride is the
    span of a packed sample (a ``None`` index gives it stride 0, which no layout has)."""
    xp = sys.modules["cupy"] if is_cupy_array(a) else numpy
    return xp.lib.stride_tricks.as_strided(a, (1, *a.shape), (a.size * a.itemsize, *a.strides))


def check_sizes(x: Any, name: str) -> None:
    """Every dimension but the batch must be positive; on the GPU the channels fewer than
    2**31 (the kernels take the count as a 32-bit argument)."""
    if any(s <= 0 for s in x.shape[1:]):
        raise ValueError(f"{name} has a zero-sized non-batch dimension: shape {x.shape}")
    if is_cupy_array(x) and x.ndim > 1 and x.shape[1] >= 2**31:
        raise ValueError(f"{name} must have fewer than 2**31 channels on the GPU (32-bit kernel "
                         f"arguments), got shape {x.shape}")


def check_per_channel(value: Any, name: str, channels: int, *, allow_scalar: bool = False,
                      broadcast_ndim: int | None = None) -> None:
    """Check a per-channel parameter, which :func:`per_channel` then flattens.

    Accepts any shape holding exactly ``channels`` values laid out per channel: ``(C,)``,
    ``(C, 1, 1)``, ``(1, C, 1, 1)``, ``(1, C, 1, 1, 1)``. With ``allow_scalar`` a Python
    number or an array of one value stands for every channel.

    ``broadcast_ndim`` is the ndim of the (N, C, ...) tensor that the parameter multiplies by
    broadcasting (``y * scale`` in PyTorch): an array of another shape than those four must
    then put its C values on the channel axis under NumPy's trailing alignment (``(C, 1, 1,
    1)`` against (N, C, D, H, W)), not on an axis that ``y * scale`` would scale instead.
    """
    if value is None:
        return
    if allow_scalar and isinstance(value, numbers.Real) and not isinstance(value, bool):
        check_scalar(value, name, finite=False)
        return
    # A NumPy scalar that is not a real number (complex, bool, string, date) is no parameter
    # value; on the GPU path it would reach CuPy as a host array.
    if (not hasattr(value, "shape") or not hasattr(value, "dtype")
            or (isinstance(value, numpy.generic) and value.dtype.kind not in "iuf")):
        kinds = "an array or a real number" if allow_scalar else "an array"
        raise TypeError(f"{name} must be {kinds}, got {type(value).__name__}")
    if value.shape == (channels,):  # the usual case
        return
    if value.shape in ((channels, 1, 1), (1, channels, 1, 1), (1, channels, 1, 1, 1)):
        return  # the layouts per channel that every parameter takes
    fits = broadcast_ndim is None or value.ndim <= broadcast_ndim
    if allow_scalar and value.size == 1 and fits:  # one value for every channel
        return
    non_unit = [s for s in value.shape if s != 1]
    if broadcast_ndim is not None and value.ndim > 1:
        axis = value.ndim - broadcast_ndim + 1  # the channel axis, aligned from the right
        fits = fits and axis >= 0 and value.shape[axis] == channels
    if value.size != channels or len(non_unit) > 1 or not fits:
        like = (1, channels) + (1,) * ((broadcast_ndim or 4) - 2)
        raise ValueError(
            f"{name} must hold one value per channel ({channels} values, shape like "
            f"({channels},) or {like}, its C values on the channel axis), "
            f"got shape {value.shape}"
        )


def as_float32(value: float) -> float:
    """``value`` as float32 GPU kernels take it (a finite value past float32's range an
    infinity), cast without NumPy's overflow warning (before any GPU work, by the callers)."""
    with numpy.errstate(over="ignore"):
        return float(numpy.float32(value))


def per_channel(value: Any, channels: int, xp):
    """The 1-D contiguous array of ``channels`` values of a parameter that
    :func:`check_per_channel` accepted (a number or one value repeated for every channel);
    None stays None. It is a new device array only for a number, one value repeated, or a
    strided parameter (the callers run every check first); otherwise a view, through which
    a running buffer is updated in place."""
    if value is None:
        return None
    if isinstance(value, numbers.Real):
        if xp is numpy:
            return numpy.full(channels, float(value), dtype=numpy.float64)
        return xp.full(channels, as_float32(value), dtype=xp.float32)
    if value.shape == (channels,):
        return xp.ascontiguousarray(value)
    if value.size == channels:  # (1, C, 1, 1) and the like, C = 1 included
        return xp.ascontiguousarray(value.reshape(channels))  # a view when contiguous
    return xp.ascontiguousarray(xp.broadcast_to(value.reshape(1), (channels,)))


def check_scalar(value: Any, name: str, *, minimum: float | None = None,
                 maximum: float | None = None, positive: bool = False,
                 finite: bool = True, nan: bool = True) -> float:
    """Check a real scalar option (finite unless ``finite=False``; then not NaN either with
    ``nan=False``) and return it as ``float``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:  # an int past float's range (too long to print, maybe)
        raise ValueError(f"{name} is out of float range") from None
    if finite and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if not nan and math.isnan(value):
        raise ValueError(f"{name} must not be NaN")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_bool(value: Any, name: str) -> bool:
    """A flag option: a bool (NumPy's too), as PyTorch's ``training``; returns it as ``bool``."""
    if not isinstance(value, (bool, numpy.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_choice(value: Any, name: str, choices: tuple, *, none: bool = False) -> Any:
    """A string option: ``TypeError`` for a value of another type (``None`` too, unless
    ``none``), ``ValueError`` for a string not among ``choices``; returns ``value`` (a
    ``str``, also for a subclass such as ``numpy.str_``)."""
    if value is None and none:
        return value
    if isinstance(value, str) and value in choices:
        return str(value)  # the message below is formed only for a refusal
    allowed = f"one of {choices}" + (" or None" if none else "")
    if not isinstance(value, str):
        raise TypeError(f"{name} must be {allowed}, got {type(value).__name__} {value!r}")
    raise ValueError(f"{name} must be {allowed}, got {value!r}")


def ntuple(value: Any, n: int, name: str, *, minimum: int) -> tuple[int, ...]:
    """Expand an int, a length-1 or a length-``n`` sequence of ints, each ``>= minimum``:
    ``TypeError`` for another type, ``ValueError`` for another length or a value out of range.

    Examples
    --------
    >>> ntuple(2, 3, "stride", minimum=1), ntuple([2], 2, "stride", minimum=1)
    ((2, 2, 2), (2, 2))
    """
    if type(value) is int:  # the common case, without the slower numbers.Integral checks
        items = (value,) * n
    else:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            items = (value,) * n
        elif isinstance(value, (tuple, list)):
            # One value stands for every dimension, as PyTorch's ``_ntuple`` reads it.
            items = tuple(value) * n if len(value) == 1 else tuple(value)
        else:
            raise TypeError(f"{name} must be an int or a sequence of {n} ints, got {value!r}")
        if not all(
            type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))
            for v in items
        ):
            raise TypeError(f"{name} must be an int or a sequence of {n} ints, got {value!r}")
        if len(items) != n:  # a wrong length is a wrong value, as PyTorch and NumPy read it
            raise ValueError(f"{name} must be an int or a sequence of {n} ints, got {value!r}")
        items = tuple(int(v) for v in items)
    if any(v < minimum for v in items):
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if any(v > MAX_OPTION for v in items):
        raise ValueError(f"{name} must be at most {MAX_OPTION}, got {value!r}")
    return items


def check_writeable(value: Any, name: str) -> None:
    """An array that the call writes must be writeable (a read-only NumPy view is not)."""
    if value is not None and not getattr(value.flags, "writeable", True):  # CuPy: always
        raise ValueError(f"{name} is read-only")


def _byte_span(a: Any) -> tuple[int, int]:
    """The [first, last) byte addresses that array ``a`` touches."""
    start = a.data.ptr if is_cupy_array(a) else a.__array_interface__["data"][0]
    if a.size == 0:
        return start, start
    if a.flags.c_contiguous:  # the usual case: one block from the first element
        return start, start + a.nbytes
    low = start + sum(s * (n - 1) for s, n in zip(a.strides, a.shape) if s < 0)
    high = start + sum(s * (n - 1) for s, n in zip(a.strides, a.shape) if s > 0)
    return low, high + a.itemsize


# The most elements whose addresses _elements_overlap compares one by one, and the work that
# _may_share_elements lets numpy.shares_memory spend.
_OVERLAP_CHECK_ELEMENTS = 2**22


def _elements_overlap(a: numpy.ndarray) -> bool:
    """Whether two elements of NumPy array ``a`` share a byte (a stride of 0 on an axis of
    more than one element, or strides that interleave); ``ValueError`` for a layout too large
    and irregular to check."""
    if a.size <= 1 or a.flags.c_contiguous or a.flags.f_contiguous:
        return False
    axes = sorted((abs(s), n) for s, n in zip(a.strides, a.shape) if n > 1)
    if axes[0][0] == 0:
        return True
    reach = a.itemsize  # bytes from an element's start to the end of the last one reached
    for stride, n in axes:
        if stride < reach:
            break
        reach += stride * (n - 1)
    else:  # each axis steps past everything that the axes below it reach
        return False
    if a.size > _OVERLAP_CHECK_ELEMENTS:
        raise ValueError("out has strides whose elements may overlap, in an array too large to "
                         "check element by element: pass an out without interleaved strides")
    offsets = numpy.zeros(1, dtype=numpy.int64)
    for stride, n in axes:
        offsets = (offsets[:, None] + numpy.arange(n, dtype=numpy.int64) * stride).ravel()
    return bool((numpy.diff(numpy.sort(offsets)) < a.itemsize).any())


def _may_share_elements(a: numpy.ndarray, b: numpy.ndarray) -> bool:
    """Whether NumPy arrays ``a`` and ``b``, whose byte spans overlap, share a byte (views
    that interleave do not); True where the exact answer takes too long to find."""
    try:
        return bool(numpy.shares_memory(a, b, max_work=_OVERLAP_CHECK_ELEMENTS))
    except numpy.exceptions.TooHardError:
        return True


def check_out(out: Any, shape: tuple[int, ...], dtype, xp, like: Any, *,
              inputs: dict[str, Any] | None = None, in_place: bool = False,
              channels_last: bool = False) -> None:
    """``out=`` must match the result's shape, dtype and array library/device exactly, be
    writeable, and share no memory with ``inputs`` (name -> array), except that with
    ``in_place`` it may be exactly an input (an op that reads each value before writing it);
    a NumPy ``out`` may interleave with an input (the reference computes its result first).
    A CuPy ``out`` must be C-contiguous, or with ``channels_last`` also packed channels-last
    (the convolutions: NHWC / NDHWC memory)."""
    if out is None:
        return
    get_array_module(out=out, x=like)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(
            f"out must have shape {tuple(shape)} and dtype {numpy.dtype(dtype).name}, "
            f"got shape {tuple(out.shape)} and dtype {out.dtype.name}"
            + ("" if out.dtype.isnative else " in non-native byte order")
        )
    if xp is not numpy and not out.flags.c_contiguous:
        if not channels_last:
            raise ValueError("out must be C-contiguous")
        if not stored_in(out, "nhwc"):
            raise ValueError("out must be C-contiguous or packed channels-last")
    check_writeable(out, "out")
    if xp is numpy and _elements_overlap(out):
        raise ValueError("out has elements that share memory (a stride of 0, or strides that "
                         "interleave): each result value needs an element of its own")
    low, high = _byte_span(out)
    for name, value in (inputs or {}).items():
        if (value is None or isinstance(value, numpy.generic) or not hasattr(value, "strides")
                or value.size == 0):  # a number or nothing: no memory to share
            continue
        v_low, v_high = _byte_span(value)
        # Same lowest address, shape and strides: exactly the same elements in the same order.
        exact = v_low == low and value.shape == out.shape and value.strides == out.strides
        if v_low < high and low < v_high and not (in_place and exact) and (
                xp is not numpy or _may_share_elements(out, value)):
            allowed = " (only exactly the same array is allowed)" if in_place else ""
            raise ValueError(f"out overlaps the memory of {name}{allowed}")


#: The largest stride, padding, dilation or window size accepted (cuDNN and the kernels take
#: them as 32-bit ints).
MAX_OPTION = 2**31 - 1


_DEVICE_MEMORY: dict[int, int] = {}  # total memory by device


def _memory_limit(xp) -> int:
    """Bytes of memory that one array may take: the current device's, or the host's."""
    if xp is numpy:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX host
            return 2**63 - 1
    device = xp.cuda.runtime.getDevice()
    limit = _DEVICE_MEMORY.get(device)
    if limit is None:
        limit = _DEVICE_MEMORY[device] = xp.cuda.runtime.getDeviceProperties(device)[
            "totalGlobalMem"]
    return limit


# False inside ``memory_unchecked``.
_MEMORY_CHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "cufused_memory_checked", default=True)


@contextlib.contextmanager
def memory_unchecked():
    """Inside, :func:`check_fits` passes every shape: for checks of a call on NumPy stand-ins
    of arrays that live elsewhere (the PyTorch fake kernels of a CUDA call), to which the
    host's memory is no limit."""
    with scoped_value(_MEMORY_CHECKED, False):
        yield


def check_fits(shape: tuple[int, ...], xp, what: str,
               cause: Callable[[], str] | None = None) -> None:
    """Raise ``ValueError`` before any work when an array of ``shape`` (float32 on the GPU,
    float64 in the reference) could not fit in memory; an empty batch (``shape[0] == 0``)
    counts one sample, which a non-empty one would need (and which cufused.dask's probe on an
    empty batch checks for its chunks). ``cause()``, formatted only for the error, names the
    arguments that set the size."""
    if not _MEMORY_CHECKED.get():
        return
    nbytes = math.prod(shape[1:]) * max(shape[0], 1) * (8 if xp is numpy else 4)
    if nbytes > _memory_limit(xp):
        per = " a sample" if shape[0] == 0 else ""
        raise ValueError(f"{what} would have shape {tuple(shape)} ({nbytes / 2**30:.3g} GiB"
                         f"{per}), more than this machine's memory"
                         + (cause() if cause is not None else ""))


def run_reference(fn, *args, **kwargs):
    """Call a float64 reference function without NumPy's floating-point warnings (NaN and inf
    inputs propagate silently, as in PyTorch)."""
    with numpy.errstate(all="ignore"):
        return fn(*args, **kwargs)


def finish_numpy(result: numpy.ndarray, dtype, out: numpy.ndarray | None) -> numpy.ndarray:
    """Cast a float64 reference result to ``dtype`` and store it in ``out`` if given; a new
    result is a C-contiguous array of its own (never a view into a larger reference buffer
    or an input), as on the GPU."""
    with numpy.errstate(all="ignore"):  # float64 values beyond float32 become inf silently
        if out is None:
            result = result.astype(dtype, order="C", copy=False)
            return result if result.base is None else result.copy()
        out[...] = result
    return out


def forward(xp, x: Any, out: Any, shape: tuple[int, ...], *, reference, gpu) -> Any:
    """The end of every op and pipeline, called once every argument is checked, ``out`` last
    (:func:`check_out`), and the per-channel parameters flattened (:func:`per_channel`), as
    Chainer's ``forward_cpu`` / ``forward_gpu`` follow ``check_type_forward``.

    An empty ``x`` gives the empty result of ``shape`` (``out`` if given); NumPy input runs
    ``reference()``, the float64 reference with the checked arguments bound, and casts its
    result to ``x.dtype`` (into ``out`` if given); CuPy input returns ``gpu(out)``, with ``out``
    allocated first where it is None.
    """
    if x.size == 0:  # the callers' checks leave only the batch axis empty (softmax: any axis)
        return out if out is not None else xp.empty(shape, dtype=x.dtype)
    if xp is numpy:
        return finish_numpy(run_reference(reference), x.dtype, out)
    if out is None:
        out = xp.empty(shape, dtype=x.dtype)
    return gpu(out)


# The ``out`` entry, Returns and Raises of an op whose result has the shape and dtype of ``x``.
_LIKE_X = """\
    out : array, optional
        Destination with the shape and dtype of ``x``.

    Returns
    -------
    array
        Same shape, dtype and array library as ``x``.

    Raises
    ------
    TypeError
        {type_error}
    ValueError
        {value_error}

"""


def insert_sections(fn: Callable, sections: str) -> Callable:
    """Put ``sections`` after ``fn``'s own parameters, before its Examples; return ``fn``."""
    if fn.__doc__:  # None under python -OO
        head, examples, tail = fn.__doc__.partition("    Examples\n")
        fn.__doc__ = head.rstrip() + "\n" + sections + examples + tail
    return fn


def like_x_sections(value_error: str,
                    type_error: str = "Mixed array libraries or an unsupported dtype."):
    """Decorator: the ``out`` entry and the Returns and Raises sections of an op whose result
    is like ``x``, with these reasons for its errors."""
    return lambda fn: insert_sections(fn, _LIKE_X.format(type_error=type_error,
                                                         value_error=value_error))
