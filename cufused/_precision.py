"""The float32 precision policy of the convolutions: a process-wide default and a scoped
override.

:func:`set_default_precision` changes the default for every thread, like the
``torch.backends`` flags; :func:`default_precision` overrides it inside a ``with`` block for
the current thread (or asyncio task) only, through a context variable, so that concurrent
code keeps its own setting.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

from ._arrays import check_choice
from ._scoped import scoped_value

PRECISIONS = ("ieee", "tf32", "3xtf32")

_process_default = ["ieee"]
_lock = threading.Lock()
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "cufused_precision_override", default=None)


def mma_passes(precision: str) -> int:
    """Tensor-core products per multiply of cufused's implicit GEMM at a TF32 ``precision``:
    3 for ``"3xtf32"`` (high * high + high * residual + residual * high), else 1."""
    return 3 if precision == "3xtf32" else 1


def _check(precision: str) -> str:
    return check_choice(precision, "precision", PRECISIONS)


def get_default_precision() -> str:
    """Return the precision used when a call passes ``precision=None``.

    Returns
    -------
    str
        The innermost :func:`default_precision` block's precision in this thread, else the
        process-wide default (``"ieee"`` until :func:`set_default_precision` changes it).

    Examples
    --------
    >>> import cufused
    >>> cufused.get_default_precision()
    'ieee'
    """
    override = _override.get()
    return _process_default[0] if override is None else override


def set_default_precision(precision: str) -> None:
    """Set the process-wide precision used when a call passes ``precision=None``.

    Every thread sees the new default, except inside a :func:`default_precision` block.

    Parameters
    ----------
    precision : {"ieee", "tf32", "3xtf32"}
        ``"ieee"`` keeps convolutions in true float32; ``"tf32"`` lets them use TF32
        tensor cores, as PyTorch does for convolutions by default; ``"3xtf32"`` splits each
        float32 operand into two TF32 parts and sums three tensor-core products (float32
        accuracy) on cufused's own convolution where it applies (2-D, one group, forward or
        transposed with stride 1; transposed 3-D with stride 2, a 3 x 3 x 3 kernel, padding 1
        and at most 32 input channels, pipeline C's, on compute capability 9.0, whose blocks
        get its 222 KiB of shared memory) and the autotuner measures it faster than cuDNN's
        exact float32; other convolutions run in ``"ieee"``. Pipeline B's
        convolution may also run through discrete Fourier transforms in ``"ieee"`` (float32
        products) and ``"3xtf32"`` (three TF32 products), where the autotuner measures that
        faster.

    Raises
    ------
    TypeError
        For a value that is not a string; the default stays as it was.
    ValueError
        For any other string; the default stays as it was.

    Examples
    --------
    >>> import cufused
    >>> cufused.set_default_precision("tf32")
    >>> cufused.get_default_precision()
    'tf32'
    >>> cufused.set_default_precision("ieee")
    """
    precision = _check(precision)
    with _lock:
        _process_default[0] = precision


@contextlib.contextmanager
def default_precision(precision: str) -> Iterator[None]:
    """Context manager that overrides the default precision inside a ``with`` block.

    The override holds in the current thread (or asyncio task) only; other threads keep the
    process-wide default. The previous setting is restored on exit.

    Parameters
    ----------
    precision : {"ieee", "tf32", "3xtf32"}
        The default inside the block.

    Yields
    ------
    None
        The block runs with ``precision`` as its default.

    Raises
    ------
    TypeError
        For a value that is not a string, on entering the block.
    ValueError
        For any other string, on entering the block.

    Examples
    --------
    >>> import cufused
    >>> with cufused.default_precision("tf32"):
    ...     cufused.get_default_precision()
    'tf32'
    >>> cufused.get_default_precision()
    'ieee'
    """
    with scoped_value(_override, _check(precision)):
        yield


def resolve_precision(precision: str | None) -> str:
    """Per-call precision, or the default when ``None``."""
    if precision is None:
        return get_default_precision()
    return check_choice(precision, "precision", PRECISIONS, none=True)
