"""The three fused pipelines (KernelBench level 2 / Tensara problem names), one module each.

Each runs its convolution through cuDNN or, at a tensor-core precision where the autotuner
measures it faster, cufused's implicit GEMM (A and C then compute their statistics in its
epilogue, the convolution output never stored), and everything after it in cufused's own
kernels, reading the large convolution output as few times as possible:

* A (:mod:`.pipeline_a`), conv2d -> GroupNorm -> scale -> MaxPool -> clamp: GroupNorm * scale
  is a per-channel affine ``a * y + b`` with ``sign(a) = sign(gamma * scale)``; a monotone map
  commutes with max (or, for ``a < 0``, turns it into min), exactly in floating point too. One
  read of the conv output yields the GroupNorm statistics (over every element, also those the
  pool drops) and each window's max or min; a small pass applies the affine and the clamp.
* B (:mod:`.pipeline_b`), ConvTranspose2d -> BatchNorm (training) -> tanh -> MaxPool ->
  GroupNorm: one read gives the per-channel batch statistics and each window's extremum (tanh
  is increasing, so the sign of the BatchNorm weight decides max or min); one block per
  (n, group) then applies BatchNorm + tanh and GroupNorm on the 4x smaller pooled tensor,
  cached in shared memory. The convolution bias cancels in training-mode BatchNorm and is only
  added to the running-mean update.
* C (:mod:`.pipeline_c`), AvgPool3d -> ConvTranspose3d -> clamp -> softmax over D*H*W -> scale:
  the pool runs first, writing the convolution's input directly in the layout its convolution
  wants; after the clamp to [lo, hi] the softmax needs no max pass (exp(v - the clamp's middle)
  within e^+-30 for hi - lo <= 60), so one statistics read and one normalize-and-scale pass
  follow, in place in the output when the layout allows.

``method="unfused"`` runs the same math as separate cufused building blocks (the baseline).
"""

from .pipeline_a import conv2d_groupnorm_scale_maxpool_clamp
from .pipeline_b import conv_transpose2d_batchnorm_tanh_maxpool_groupnorm
from .pipeline_c import conv_transpose3d_avgpool_clamp_softmax_multiply

__all__ = [
    "conv2d_groupnorm_scale_maxpool_clamp",
    "conv_transpose2d_batchnorm_tanh_maxpool_groupnorm",
    "conv_transpose3d_avgpool_clamp_softmax_multiply",
]
