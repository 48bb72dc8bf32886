"""Shared by the cufused.dask tests: batch chunkings, chunked inputs, the pipelines' cases."""

from __future__ import annotations

import numpy as np

from conftest import mixed

# Batch chunkings of N = 5: chunks of 1, an uneven last chunk, the whole batch in one.
CHUNKINGS = [(1, 1, 1, 1, 1), (2, 2, 1), (5,)]


def chunked(x, chunks):
    import dask.array as da

    return da.from_array(x, chunks=(chunks,) + tuple(-1 for _ in x.shape[1:]))


def case_a(rng, dtype=np.float32):
    x = rng.random((5, 3, 12, 10)).astype(dtype)
    params = (rng.standard_normal((8, 3, 3, 3)).astype(dtype), rng.standard_normal(8),
              mixed(rng, 8), rng.standard_normal(8), mixed(rng, 8).reshape(8, 1, 1))
    options = dict(num_groups=4, pool_kernel=3, clamp_min=-0.5, clamp_max=0.8, padding=1)
    return x, params, options


def case_b(rng, dtype=np.float32):
    """Pipeline B with mixed-sign BatchNorm weights, a conv bias and grouped channels."""
    x = rng.random((5, 4, 5, 6)).astype(dtype)
    weight = rng.standard_normal((4, 4, 3, 3)).astype(dtype)  # groups=2: C_out = 8
    params = (weight, mixed(rng, 8, dtype), rng.standard_normal(8).astype(dtype),
              mixed(rng, 8, dtype), rng.standard_normal(8).astype(dtype))
    options = dict(num_groups=2, stride=2, padding=1, output_padding=1, groups=2,
                   conv_bias=rng.standard_normal(8).astype(dtype), pool_kernel=2, eps=1e-4,
                   momentum=0.3)
    return x, params, options


def case_c(rng, dtype=np.float32):
    x = rng.random((5, 2, 4, 6, 4)).astype(dtype)
    params = (rng.standard_normal((2, 3, 3, 3, 3)).astype(dtype), mixed(rng, 3))
    options = dict(stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=0.0,
                   clamp_max=1.0, conv_bias=rng.standard_normal(3))
    return x, params, options


PER_SAMPLE_PIPELINES = [("conv2d_groupnorm_scale_maxpool_clamp", case_a),
                        ("conv_transpose3d_avgpool_clamp_softmax_multiply", case_c)]
