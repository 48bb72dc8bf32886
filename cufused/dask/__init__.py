"""Scale out on Dask: every pipeline and building block over a ``dask.array.Array``.

The input is chunked along the batch axis only (every other axis in one chunk), with NumPy
chunks (the float64 reference runs on each) or CuPy chunks (the GPU path runs on each). Every
function checks its arguments and returns a lazy dask array with the result's shape, dtype,
chunks and chunk type (``meta``); nothing is computed until the result is. Parameters
(weights, biases, norm affines) are NumPy or CuPy arrays of the chunks' library that every
chunk reads whole; each is one key of the graph, which Dask neither traverses nor copies per
task.

Most operations are independent per sample and run the single call on each chunk: the
convolutions, GroupNorm, the pools, softmax over non-batch axes, BatchNorm in inference, and
pipelines A and C. BatchNorm in training mode, alone or inside pipeline B, normalizes with the
statistics of the whole batch, in three phases:

1. per chunk, the per-channel partial moments (count, mean, M2) in float64, the mean an offset
   from the chunk's first value (as the single call shifts its sums); in pipeline B the
   transposed convolution and each pooling window's extremum (the BatchNorm weight's sign
   decides max or min, since ``tanh(a * v + b)`` is monotone in ``v``) come with them, so
   only the extrema (k * k times fewer values for a k x k pool) cross to phase 3;
2. a tree reduction of the partial moments (Chan's parallel formula, ``split_every`` parts per
   node) into the batch mean and variance, whose task also updates the running buffers;
3. per chunk, the normalization (``batch_norm`` in inference mode with the batch statistics,
   then in pipeline B ``tanh`` and ``group_norm`` on the pooled data).

The result equals the single call on the concatenated batch to float32 rounding. On CuPy
chunks pipeline B's phases run the single call's kernels (``pipeline_b``'s chunk phases): one
read of the convolution output for the extrema and the sums, one pass over the extrema for
BatchNorm, tanh and GroupNorm. On NumPy chunks, for samples of more convolution outputs than
the fused pass takes (``FUSED_SAMPLE_VALUES``, 2**31 - 2**16) and for a BatchNorm factor
that can be infinite (an infinite weight, or ``bn_weight / sqrt(eps)`` past the range) they
compose the public operations, phase 1 passing the pooled extrema to phase 3 as before; only
an infinite factor, whose windows need the whole convolution output in phase 3 (as in the
single call), makes that whole output cross from phase 1 to phase 3.

Running buffers are updated in place by the statistics task, once each time a computation
runs it (``compute``/``persist`` of the result, or of anything depending on it). The
threaded and synchronous schedulers, and distributed workers in this process, run it on the
caller's buffers; a task in another process (distributed workers in processes of their own,
dask's ``"processes"`` scheduler) updates that process's copy, so there
``return_running_stats=True`` returns the updated buffers as dask arrays to compute along with
the result. Statistics tasks that run at once take turns on the buffers, in an order Dask
chooses: graphs that share running buffers are computed one after the other. One built
graph is one call: a distributed scheduler does not run again a task whose result the
cluster still holds, so there a second ``compute`` of a persisted graph moves the buffers
once.

With CuPy chunks the tasks of a process take turns on each device (one at a time), so that
the threaded scheduler's threads do not interleave their chunks on the device's stream.

Every call builds its graph directly (a dict of tasks over the keys of ``x``'s chunks) under
key names unique to the call: the readable prefix ``cufused-<function>-`` and a random token,
not a hash of the inputs, since hashing would copy every CuPy parameter to the host. Two
equal calls are therefore not deduplicated: computed together, each runs (and in training
each updates the running buffers, as two single calls would, in an order Dask chooses).
"""

from __future__ import annotations

try:
    import dask.array  # noqa: F401 - every module of this package builds on it
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("cufused.dask needs Dask: install cufused[dask] "
                      "(dask[array,distributed]; dask-cuda for GPU clusters)") from exc

import cufused

from ._blocks import (avg_pool2d, avg_pool3d, batch_norm, conv2d, conv3d, conv_transpose2d,
                      conv_transpose3d, group_norm, max_pool2d, max_pool3d, softmax)
from ._pipelines import (conv2d_groupnorm_scale_maxpool_clamp,
                         conv_transpose2d_batchnorm_tanh_maxpool_groupnorm,
                         conv_transpose3d_avgpool_clamp_softmax_multiply)

# cufused's public functions on arrays, each of which this package defines over a dask batch
# (imported above; cufused's settings and prepare are cufused's own).
__all__ = [name for name in cufused.__all__ if name in globals()]
