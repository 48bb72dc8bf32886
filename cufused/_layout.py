"""Memory layouts of logical (N, C, *spatial) arrays: NC(D)HW ("nchw") or channels-last
("nhwc"), as the kernels, the cuDNN plans and the ops all describe them."""

from __future__ import annotations


def layout_strides(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """Element strides of a logical (N, C, *spatial) shape stored in ``layout``.

    Examples
    --------
    >>> layout_strides((2, 3, 4, 5), "nchw")
    (60, 20, 5, 1)
    >>> layout_strides((2, 3, 4, 5), "nhwc")
    (60, 1, 15, 3)
    """
    if layout == "nchw":
        physical = shape
    else:
        physical = (shape[0], *shape[2:], shape[1])
    strides = [1] * len(shape)
    for i in range(len(physical) - 2, -1, -1):
        strides[i] = strides[i + 1] * physical[i + 1]
    if layout == "nchw":
        return tuple(strides)
    return (strides[0], strides[-1], *strides[1:-1])


def empty_in_layout(shape: tuple[int, ...], layout: str):
    """A CuPy float32 array of logical ``shape`` whose memory is in ``layout``."""
    import cupy  # a GPU path's buffer: CuPy is imported already
    if layout == "nchw":
        return cupy.empty(shape, dtype=cupy.float32)
    nd = len(shape)
    physical = cupy.empty((shape[0], *shape[2:], shape[1]), dtype=cupy.float32)
    return physical.transpose(0, nd - 1, *range(1, nd - 1))


def stored_in(a, layout: str) -> bool:
    """Whether the memory of ``a`` (logical N, C, *spatial) is exactly ``layout``, packed, by
    its strides: unlike the contiguity flags, also those of axes of extent 1, so that an
    array is in at most one of the layouts.

    Examples
    --------
    >>> import numpy as np
    >>> a = np.zeros((2, 4, 5, 3)).transpose(0, 3, 1, 2)  # NHWC memory, logical NCHW
    >>> stored_in(a, "nhwc"), stored_in(a, "nchw")
    (True, False)
    """
    return a.strides == tuple(s * a.itemsize for s in layout_strides(a.shape, layout))
