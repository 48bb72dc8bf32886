"""Launch helpers shared by the launcher modules (the host side of ``common.cuh``)."""

from __future__ import annotations

# Aim for at least this many blocks in a split reduction.
_TARGET_BLOCKS = 2048


def split_count(keys: int, elements_per_key: int) -> int:
    """How many blocks share one statistics key (``split_range`` in common.cuh): enough
    blocks overall, at least 1024 values each."""
    want = -(-_TARGET_BLOCKS // max(keys, 1))
    return max(1, min(want, -(-elements_per_key // 1024)))


def cpp_bool(flag) -> str:
    """A template argument for a ``bool`` parameter: ``"true"`` or ``"false"``."""
    return "true" if flag else "false"
