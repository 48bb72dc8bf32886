"""A transposed convolution as forward convolutions (sub-pixel decomposition).

Output position ``o = s * i - p + k`` of a transposed convolution (stride ``s``, padding
``p``, kernel tap ``k``) only receives taps with ``k = (o + p) mod s``. Split the output by the
residue ``r = o mod s`` in every dimension: each residue class ``o = s * m + r`` is an ordinary
stride-1 cross-correlation of the input with a sub-kernel of about ``k / s`` taps (flipped,
in/out channels swapped), so no multiply-by-zero of the scattered formulation is left. With
stride 1 this is the single forward convolution with the flipped kernel.

In float32 without tensor cores, pipeline C's stride-2 transposed 3-D convolution runs
several times faster as 8 forward sub-convolutions writing packed per-class blocks than as cuDNN's
data-gradient convolution; writing the classes interleaved into one output through strided
tensors sends cuDNN to slow engines, so the classes stay in separate blocks ("class-major")
and the kernels that read the result interleave them (figures: docs/design.rst).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy


@dataclass(frozen=True)
class SubpixelPart:
    """One residue class: a stride-1 forward convolution of a cropped input window."""

    residue: tuple[int, ...]  # r per spatial dimension
    first_tap: tuple[int, ...]  # the smallest transposed-conv tap k with k = (r + p) mod s
    taps: tuple[int, ...]  # sub-kernel size per dimension
    x_start: tuple[int, ...]  # input window start (where the padding would be negative)
    x_size: tuple[int, ...]  # input window extent
    pre_padding: tuple[int, ...]
    post_padding: tuple[int, ...]


def subpixel_parts(x_spatial, kernel, stride, padding, out_spatial) -> list[SubpixelPart] | None:
    """The residue classes of a transposed convolution (dilation 1), or None if it does not split.

    It splits when every output extent is a multiple of its stride (all classes then have the
    same size, ``out / stride``) and every kernel extent is at least its stride (every class
    gets a tap).

    Examples
    --------
    >>> parts = subpixel_parts((16,), (3,), (2,), (1,), (32,))
    >>> [(p.residue, p.taps, p.pre_padding, p.post_padding) for p in parts]
    [((0,), (1,), (0,), (0,)), ((1,), (2,), (0,), (1,))]
    """
    per_dim = []
    for size, k, s, p, out in zip(x_spatial, kernel, stride, padding, out_spatial):
        if out % s or k < s:
            return None
        m = out // s
        classes = []
        for r in range(s):
            k0 = (r + p) % s
            taps = (k - k0 + s - 1) // s
            shift = (r + p - k0) // s  # class position m reads input m + shift - j for tap j
            pre = taps - 1 - shift
            post = m - 1 + taps - size - pre
            start = max(0, -pre)
            extent = size - start + min(0, post)
            if extent <= 0:
                return None
            classes.append((r, k0, taps, start, extent, max(pre, 0), max(post, 0)))
        per_dim.append(classes)
    return [SubpixelPart(*(tuple(c[i] for c in combo) for i in range(7)))
            for combo in itertools.product(*per_dim)]


def subpixel_weight_index(w_shape, groups: int, stride, parts: list[SubpixelPart],
                          channels_last: bool, align: int = 1) -> numpy.ndarray:
    """Flat gather indices that turn a ConvTranspose weight into every part's sub-kernel.

    ``weight.ravel()[index]`` is the concatenation of the parts' forward-convolution weights,
    each of logical shape ``(C_out, C_in / groups, *taps)`` (stored channels-last when asked):
    ``W'[g * Co + o, i, t] = W[g * Ci + i, o, first_tap + (taps - 1 - t) * stride]``. Each
    part starts at a multiple of ``align`` elements (the gaps repeat element 0).
    """
    c_in, c_out_g = w_shape[:2]
    c_in_g = c_in // groups
    flat = numpy.arange(int(numpy.prod(w_shape)), dtype=numpy.int64).reshape(w_shape)
    chunks = []
    for part in parts:
        taps = tuple(
            numpy.array([k0 + (t - 1 - j) * s for j in range(t)])
            for k0, t, s in zip(part.first_tap, part.taps, stride))
        sub = flat[(slice(None), slice(None)) + numpy.ix_(*taps)]  # (C_in, Co_g, *taps)
        sub = sub.reshape(groups, c_in_g, c_out_g, *part.taps).swapaxes(1, 2)
        sub = sub.reshape(groups * c_out_g, c_in_g, *part.taps)  # (C_out, Ci_g, *taps)
        if channels_last:
            sub = numpy.moveaxis(sub, 1, -1)
        chunks.append(sub.ravel())
        chunks.append(numpy.zeros(-sub.size % align, dtype=numpy.int64))
    return numpy.concatenate(chunks)
