"""cufused from PyTorch: custom operators ``torch.ops.cufused.*`` and KernelBench modules.

Importing this module registers every cufused function as a PyTorch operator in the
``cufused`` namespace (``torch.library.Library`` with ``define`` / ``impl``, the route with the
least per-call overhead), with fake kernels so that ``torch.compile(fullgraph=True)`` and
``torch.export`` trace models that call them:

* CUDA tensors go to cufused zero-copy as CuPy views of the same memory; the work runs on
  PyTorch's current stream (also inside ``torch.cuda.graph`` capture), into an output that
  PyTorch's caching allocator owns.
* CPU tensors run the float64 reference (NumPy) and come back as tensors of the input dtype.

The operators are forward-only: a call with an input that requires grad while grad mode is on
raises ``RuntimeError`` (run under ``torch.no_grad()`` or ``torch.inference_mode()``). The
modules also run in grad mode, with a result whose backward raises ``NotImplementedError``
(compiled models too: the backward is an operator, ``_no_backward``, traced by its fake
kernel); ``torch.export`` traces a module in grad mode, and the exported program runs the
operator without autograd (its result does not require grad).

The three ``nn.Module`` classes take the constructor arguments of the KernelBench level 2
models in their order, create the same submodules and parameters (same initialization, same
``state_dict`` keys) and run the fused pipeline in ``forward``.
"""

from __future__ import annotations

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("cufused.torch needs PyTorch: install torch (the oracle extra, or "
                      "PyTorch's CPU build on a machine without a GPU)") from exc

from cufused.torch._kernels import (_cpu_kernel, _cuda_kernel, _fake_kernel, no_backward_fake,
                                    refuse_backward)
from cufused.torch._kernels import _cupy_view as _cupy_view
from cufused.torch._modules import (
    Conv2dGroupNormScaleMaxPoolClamp,
    ConvTranspose2dBatchNormTanhMaxPoolGroupNorm,
    ConvTranspose3dAvgPoolClampSoftmaxMultiply,
)
from cufused.torch._shapes import OPERATORS

__all__ = [
    "Conv2dGroupNormScaleMaxPoolClamp",
    "ConvTranspose2dBatchNormTanhMaxPoolGroupNorm",
    "ConvTranspose3dAvgPoolClampSoftmaxMultiply",
    "OPERATORS",
]

# The one registration of the operators, on the first ``import cufused.torch``; the submodules
# register nothing. ``_LIB`` must stay referenced: a collected Library removes its operators.
_LIB = torch.library.Library("cufused", "DEF")
for _name, (_schema, _shape) in OPERATORS.items():
    _LIB.define(_name + _schema)
    _LIB.impl(_name, _cpu_kernel(_name), "CPU")
    _LIB.impl(_name, _cuda_kernel(_name, _shape), "CUDA")
    torch.library.register_fake(f"cufused::{_name}", _fake_kernel(_name, _shape), lib=_LIB)
del _name, _schema, _shape
# The backward of a module's result in grad mode: traced whole, it raises where it runs.
_LIB.define("_no_backward(str name, Tensor grad, Tensor[] inputs) -> Tensor[]")
_LIB.impl("_no_backward", refuse_backward, "CompositeExplicitAutograd")
torch.library.register_fake("cufused::_no_backward", no_backward_fake, lib=_LIB)
