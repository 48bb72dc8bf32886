"""A context variable set for the length of a ``with`` block: the one idiom behind cufused's
per-thread (and per-asyncio-task) settings and markers."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def scoped_value(var: contextvars.ContextVar[T], value: T) -> Iterator[T]:
    """Set ``var`` to ``value`` inside the block, in the current context only, and yield
    ``value``; the previous value comes back on leaving, also on an exception."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)
