"""Launchers of ``normalization.cu``: split statistics, their finalization into per-channel
affine coefficients, the affine (+ activation) apply pass, and a one-block-per-row GroupNorm.

Statistics are sums shifted by each key's first value (so ``|mean| >> std`` stays accurate;
``key_stats_partial`` takes 0 for an infinite one), combined in float64 by ``stats_finalize``;
``key_stats_partial`` and ``group_norm_rows`` sum ``d`` in float64 per thread (so
``|mean| << std`` stays accurate) and ``d * d`` in float32 with its rounding errors carried
(``SquareSum``: a first value far from the mean scales ``sum d * d`` and a plain sum's
rounding). Coefficients are a (3, K) float32 array (``coef_array``):
entry k maps ``v`` to ``coef[0, k] * (v - coef[1, k]) + coef[2, k]`` (``ChannelAffine`` in
common.cuh: the centered form ``gamma * rstd * (v - mean) + beta`` where it is finite, on the
float64 mean where the sums are of the normalized values themselves (``centered_sums``; not
pipeline A's with a convolution bias), PyTorch's ``a * v + b`` otherwise).
"""

from __future__ import annotations

import numpy

from .._arrays import as_float32
from .._cuda import MAX_GRID_X, get_kernel, launch_1d, optional
from .._layout import stored_in
from ._common import cpp_bool, split_count

_FILE = "normalization.cu"

# The ACT_* code of an activation (channel_affine) or of a GroupNorm row's pre-map.
_ACT = {None: "ACT_NONE", "tanh": "ACT_TANH", "clamp": "ACT_CLAMP"}
# Rows up to this many float32 values stay in shared memory between the two passes.
ROW_CACHE_BYTES = 48 * 1024


def key_stats_partial(xp, x, keys: int, *, n_outer: int, outer_stride: int, key_stride: int,
                      inner: int):
    """Shifted sums of each of ``keys`` statistics keys over
    ``x[o * outer_stride + key * key_stride + i]`` (o < n_outer, i < inner), split across
    blocks; returns ``(partial, shift, splits)``: partial (keys, splits, 2) float64 sums of
    ``d`` and ``d * d`` with ``d = x - shift``, shift (keys,) each key's first
    value, 0 where infinite."""
    splits = split_count(keys, n_outer * inner)
    partial = xp.empty((keys, splits, 2), dtype=xp.float64)
    shift = xp.empty(keys, dtype=xp.float32)
    get_kernel(_FILE, "key_stats_partial")(
        (keys * splits,), (256,),
        (x, partial, shift, numpy.int64(n_outer), numpy.int64(outer_stride),
         numpy.int64(key_stride), numpy.int64(inner), numpy.int32(splits)))
    return partial, shift, splits


def finalize_threads(partials_per_row: int) -> int:
    """Threads of a ``stats_finalize`` block: fewer for short rows (pipeline A sums 16)."""
    return min(256, 32 * max(1, -(-partials_per_row // 32)))


def coef_array(xp, k: int):
    """An uninitialized (3, k) array of normalization coefficients."""
    return xp.empty((3, k), dtype=xp.float32)


def _stats_finalize(mode: str, rows: int, *, partial, shift, n_outer: int, outer_stride: int,
                    row_len: int, count: int, gamma, beta, scale, coef, channels: int,
                    groups: int, eps: float, training: bool, centered_sums: bool,
                    centered_only: bool, running_mean, running_var, running_mean_lo,
                    mean_offset, momentum: float, moments) -> None:
    """``stats_finalize<mode>``, one block per statistics row (see the kernel)."""
    get_kernel(_FILE, f"stats_finalize<{mode}>")(
        (rows,), (finalize_threads(n_outer * row_len),),
        (optional(partial), optional(shift), numpy.int64(n_outer), numpy.int64(outer_stride),
         numpy.int32(row_len), numpy.float64(count), optional(gamma), optional(beta),
         optional(scale), coef, numpy.int64(coef.shape[1]), numpy.int32(channels),
         numpy.int32(groups), numpy.float64(eps), numpy.int32(training),
         numpy.int32(centered_sums), numpy.int32(centered_only), optional(running_mean),
         optional(running_var), optional(running_mean_lo), optional(mean_offset),
         numpy.float32(as_float32(momentum)), optional(moments)))


def group_norm_coefficients(partial, shift, coef, *, rows: int, row_len: int, count: int,
                            channels: int, num_groups: int, eps: float, centered_sums: bool,
                            gamma=None, beta=None, scale=None, moments=None,
                            centered_only: bool = False) -> None:
    """GroupNorm (times ``scale``) as per-(n, c) coefficients.

    Row ``n * num_groups + g`` has its ``row_len`` shifted-sum partials at
    ``partial[row * row_len + m]`` over ``count`` values; ``coef`` (3, N * C) receives the
    coefficients, ``moments`` (optional, rows x float2) each row's (mean, rstd).
    ``centered_sums``: the partials sum the normalized values themselves, so the affine
    centers on the float64 mean (``NormMoments`` in common.cuh). ``centered_only`` keeps the
    centered form for non-finite coefficients too, as PyTorch CUDA's GroupNorm of one value
    per channel does (``ChannelAffine::of``).
    """
    _stats_finalize("MODE_GROUP_NORM", rows, partial=partial, shift=shift, n_outer=1,
                    outer_stride=0, row_len=row_len, count=count, gamma=gamma, beta=beta,
                    scale=scale, coef=coef, channels=channels, groups=num_groups, eps=eps,
                    training=True, centered_sums=centered_sums,
                    centered_only=centered_only, running_mean=None,
                    running_var=None, running_mean_lo=None, mean_offset=None, momentum=0.0,
                    moments=moments)


def batch_norm_coefficients(partial, shift, coef, *, n_outer: int, outer_stride: int,
                            row_len: int, count: int, channels: int, eps: float, training: bool,
                            gamma, beta, running_mean, running_var, mean_offset, momentum: float,
                            moments, running_mean_lo=None, centered_only: bool = False) -> None:
    """BatchNorm as per-channel coefficients (``coef``, (3, C)), one block per channel.

    In training channel c's partials sit at ``partial[o * outer_stride + c * row_len + m]``
    (o < n_outer) over ``count`` values, and the running buffers (optional) are updated in
    place; otherwise (``partial``, ``shift`` None) the running statistics are used, the mean
    plus ``running_mean_lo`` (optional: the float32 remainder of a float64 mean).
    ``centered_only`` as ``group_norm_coefficients``'s (PyTorch CUDA's native BatchNorm).
    """
    _stats_finalize("MODE_BATCH_NORM", channels, partial=partial, shift=shift, n_outer=n_outer,
                    outer_stride=outer_stride, row_len=row_len, count=count, gamma=gamma,
                    beta=beta, scale=None, coef=coef, channels=channels,
                    groups=channels, eps=eps, training=training, centered_sums=True,
                    centered_only=centered_only, running_mean=running_mean, running_var=running_var,
                    running_mean_lo=running_mean_lo, mean_offset=mean_offset,
                    momentum=momentum, moments=moments)


def channel_affine(x, y, coef, *, inner: int, activation: str | None = None, lo: float = 0.0,
                   hi: float = 0.0) -> None:
    """``y = act(coef[0, k] * (x - coef[1, k]) + coef[2, k])`` over contiguous planes of
    ``inner`` values, k = plane % K (coef: (3, K)): one flat grid-stride pass, 16-byte
    accesses where aligned.
    ``activation``: None, "tanh" or "clamp" (to [lo, hi])."""
    vec = 4 if (x.size % 4 == 0 and inner >= 4 and x.data.ptr % 16 == 0
                and y.data.ptr % 16 == 0) else 1
    n_vec = x.size // vec
    launch_1d(get_kernel(_FILE, f"channel_affine<{_ACT[activation]}, {vec}>"),
              -(-n_vec // 4),  # 4 per thread
              (x, y, coef, numpy.int64(n_vec), numpy.int64(inner),
               numpy.int64(coef.shape[1]), numpy.float32(lo), numpy.float32(hi)))


def group_affine_rows(x, y, partial, *, num_groups: int, count: int, eps: float,
                      centered_sums: bool, gamma, beta, scale, lo: float, hi: float,
                      moments) -> None:
    """``y = clamp(f(x), lo, hi)`` with the GroupNorm (times ``scale``) affine ``f`` from
    partials with shifts and counts of their own (``partial`` (N, C, runs, 4): sum, sum of
    squares, shift, count as int32 bits; ``count`` values per (n, g) row):
    :func:`group_norm_coefficients` and :func:`channel_affine` in one kernel, one block per
    row of the contiguous (N, C, H, W) ``x`` (``x`` may be ``y``). ``centered_sums``: as
    :func:`group_norm_coefficients` takes it. ``moments`` (N * num_groups, 2; optional)
    receives each row's (mean, rstd)."""
    n, c = x.shape[:2]
    rows = n * num_groups
    if x.size == 0:
        return
    hw = x.size // (n * c)
    cg = c // num_groups
    vec = 4 if (cg * hw % 4 == 0 and hw >= 4 and x.data.ptr % 16 == 0
                and y.data.ptr % 16 == 0) else 1
    i32 = numpy.int32
    get_kernel(_FILE, f"group_affine_rows<{_ACT['clamp']}, {vec}>")(
        (rows,), (256,),
        (x, y, partial, i32(cg * partial.shape[2]), numpy.float64(count), optional(gamma),
         optional(beta), optional(scale), i32(c), i32(num_groups), i32(hw), numpy.float64(eps),
         i32(centered_sums), numpy.float32(lo), numpy.float32(hi), optional(moments)))


def group_rows_fit_channels_last(c: int, num_groups: int, hw: int) -> bool:
    """Whether GroupNorm rows of this shape can be read from a channels-last (N, HW, C)
    input: groups of 4, 8, ..., 128 channels (a thread keeps one 16-byte channel quad), rows
    that stay cached in shared memory."""
    cg = c // num_groups
    return cg % 4 == 0 and 32 % (cg // 4) == 0 and cg * hw * 4 <= ROW_CACHE_BYTES


def reads_channels_last(x, num_groups: int) -> bool:
    """Whether ``group_norm_rows`` reads ``x`` in place as channels-last: stored so,
    16-byte aligned, with rows that ``group_rows_fit_channels_last`` allows."""
    n, c = x.shape[:2]
    hw = x.size // max(n * c, 1)
    return (x.ndim > 2 and c > 1 and hw > 1 and stored_in(x, "nhwc") and x.data.ptr % 16 == 0
            and group_rows_fit_channels_last(c, num_groups, hw))


def group_norm_threads(shared_bytes: int) -> int:
    """Threads of a GroupNorm row block that caches ``shared_bytes``: 128 while 8 blocks fit
    in an SM's shared memory (more blocks per SM overlap one block's reductions with another's
    loads: the fastest block size for B's GroupNorm, docs/design.rst), else 256, so that an
    SM still runs 1024 threads."""
    return 128 if 8 * shared_bytes <= 224 * 1024 else 256


def group_norm_rows(x, y, weight, bias, *, num_groups: int, eps: float, pre=None,
                    x_block: int | None = None) -> None:
    """GroupNorm of ``x`` (N, C, ...) into contiguous ``y`` with one block per (n, group) row.

    ``x`` is contiguous, or channels-last where ``reads_channels_last`` allows. With
    ``x_block``, the memory of ``x`` holds channels-last values in blocks of ``x_block``
    channels, a whole number of groups (``blocked_channels_last`` in common.cuh), whatever
    its strides say, with rows that ``group_rows_fit_channels_last`` allows and 16-byte
    alignment; ``x`` may then be ``y`` when a block is one group.
    ``pre`` (coefficients (3, C)) first maps each value to
    ``tanh(pre[0, c] * (x - pre[1, c]) + pre[2, c])``.
    The row stays in shared memory between statistics and normalize when it fits in
    ``ROW_CACHE_BYTES``, and is then visited one warp per channel where a channel has at
    least 32 values; 16-byte accesses when the row length and pointers allow. More rows than
    a grid holds (``MAX_GRID_X``) run in launches over slices of the batch (``x[n0:n1]``:
    its first stride is a sample's values, blocked or not). Rows of one value per channel
    keep the centered form for non-finite coefficients too, as PyTorch CUDA's GroupNorm of
    such inputs does (``centered_only``, ``ChannelAffine::of``); their ``x`` is not blocked.
    """
    n, c = x.shape[:2]
    hw = x.size // max(n * c, 1)
    length = (c // num_groups) * hw
    cache = length * 4 <= ROW_CACHE_BYTES
    vec = 4 if (length % 4 == 0 and hw >= 4 and x.data.ptr % 16 == 0
                and y.data.ptr % 16 == 0) else 1
    act = _ACT["tanh" if pre is not None else None]
    if pre is not None and pre.shape != (3, c):
        raise ValueError(f"pre has shape {pre.shape}; the pre-map needs (3, {c})")
    if x_block is None and reads_channels_last(x, num_groups):
        x_block = c
    elif x_block is not None and not (x_block % (c // num_groups) == 0 and c % x_block == 0
                                      and group_rows_fit_channels_last(c, num_groups, hw)
                                      and x.data.ptr % 16 == 0):
        raise ValueError(f"x_block={x_block} needs whole groups of 4k channels per block, rows "
                         "that fit in shared memory and 16-byte alignment")
    if x_block is not None:
        name = f"group_norm_rows_cached<{act}, {vec}, true>"
    elif not x.flags.c_contiguous:
        raise ValueError("x must be contiguous, or channels-last as reads_channels_last allows")
    elif cache and hw >= 32:
        name = f"group_norm_rows_cached<{act}, {vec}, false>"
    else:
        name = f"group_norm_rows<{act}, {cpp_bool(cache)}, {vec}>"
    shared = length * 4 if cache else 0
    args = (optional(pre), optional(weight), optional(bias),
            numpy.int32(c), numpy.int32(num_groups), numpy.int32(hw), numpy.float64(eps))
    if name.startswith("group_norm_rows_cached"):
        if hw == 1:
            raise ValueError("x_block needs rows of more than one value per channel")
        args += (numpy.int32(x_block or 0),)  # read only for channels-last blocks
    else:
        args += (numpy.int32(hw == 1),)  # centered_only
    kernel = get_kernel(_FILE, name, shared_bytes=shared)
    per_launch = MAX_GRID_X // num_groups  # samples whose rows one grid holds
    for n0 in range(0, n, per_launch):
        part = slice(n0, n0 + per_launch)
        samples = (x, y) if n <= per_launch else (x[part], y[part])
        kernel((min(n - n0, per_launch) * num_groups,), (group_norm_threads(shared),),
               samples + args, shared_mem=shared)
