"""cufused: fused GPU operator pipelines for convolutional networks, on CuPy and cuDNN.

NumPy arrays in run the float64 reference on the CPU; CuPy arrays in run cuDNN convolutions
and cufused's own fused CUDA kernels on the GPU.
"""

from ._call_graphs import clear_caches
from ._cudnn import clear_plan_cache
from ._ops.convolution import conv2d, conv3d, conv_transpose2d, conv_transpose3d
from ._ops.normalization import batch_norm, group_norm
from ._ops.pooling import avg_pool2d, avg_pool3d, max_pool2d, max_pool3d
from ._ops.softmax import softmax
from ._precision import default_precision, get_default_precision, set_default_precision
from ._prepared import prepare
from ._settings import set_conv_autotune, set_conv_graph_replay
from .pipelines import (conv2d_groupnorm_scale_maxpool_clamp,
                        conv_transpose2d_batchnorm_tanh_maxpool_groupnorm,
                        conv_transpose3d_avgpool_clamp_softmax_multiply)

__version__ = "0.1.0"

__all__ = [
    "conv2d", "conv3d", "conv_transpose2d", "conv_transpose3d",
    "group_norm", "batch_norm",
    "max_pool2d", "max_pool3d", "avg_pool2d", "avg_pool3d",
    "softmax",
    "conv2d_groupnorm_scale_maxpool_clamp",
    "conv_transpose2d_batchnorm_tanh_maxpool_groupnorm",
    "conv_transpose3d_avgpool_clamp_softmax_multiply",
    "get_default_precision", "set_default_precision", "default_precision",
    "set_conv_autotune", "set_conv_graph_replay", "clear_plan_cache", "clear_caches",
    "prepare",
]
