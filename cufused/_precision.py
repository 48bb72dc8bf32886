"""Process-wide float32 precision policy for the cuDNN convolutions."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

PRECISIONS = ("ieee", "tf32")

_default = contextvars.ContextVar("cufused_precision", default="ieee")


def _check(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} or None, got {precision!r}")
    return precision


def get_default_precision() -> str:
    """Return the precision used when a call passes ``precision=None``.

    Returns
    -------
    str
        ``"ieee"`` (true float32, the initial default) or ``"tf32"``.

    Examples
    --------
    >>> import cufused
    >>> cufused.get_default_precision()
    'ieee'
    """
    return _default.get()


def set_default_precision(precision: str) -> None:
    """Set the precision used when a call passes ``precision=None``.

    Parameters
    ----------
    precision : {"ieee", "tf32"}
        ``"ieee"`` keeps convolutions in true float32; ``"tf32"`` lets cuDNN use TF32
        tensor cores, as PyTorch does for convolutions by default.

    Raises
    ------
    ValueError
        For any other value.

    Examples
    --------
    >>> import cufused
    >>> cufused.set_default_precision("tf32")
    >>> cufused.get_default_precision()
    'tf32'
    >>> cufused.set_default_precision("ieee")
    """
    _default.set(_check(precision))


@contextlib.contextmanager
def default_precision(precision: str) -> Iterator[None]:
    """Context manager that sets the default precision inside a ``with`` block.

    Parameters
    ----------
    precision : {"ieee", "tf32"}
        The default inside the block; the previous default is restored on exit.

    Raises
    ------
    ValueError
        For any other value.

    Examples
    --------
    >>> import cufused
    >>> with cufused.default_precision("tf32"):
    ...     cufused.get_default_precision()
    'tf32'
    >>> cufused.get_default_precision()
    'ieee'
    """
    token = _default.set(_check(precision))
    try:
        yield
    finally:
        _default.reset(token)


def resolve_precision(precision: str | None) -> str:
    """Per-call precision, or the default when ``None``."""
    return _default.get() if precision is None else _check(precision)
