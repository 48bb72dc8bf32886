"""The benchmark cases: the three pipelines at their canonical (KernelBench level 2) and small
sizes, their inputs, their float64 reference and their PyTorch equivalents, and the error
metric of ``python -m cufused check``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy

import cufused

from .. import reference
from .._arrays import import_cupy, is_cupy_array


#: The largest relative error (:func:`rel_err`) against the float64 reference that ``check``
#: and ``bench`` accept of a pipeline's result, per precision.
TOLERANCE = {"ieee": 1e-4, "tf32": 5e-3, "3xtf32": 1e-4}


def rel_err(out, ref) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN in ``out`` where ``ref`` has none gives inf.

    With a CuPy array among them, it is computed on the GPU.

    Examples
    --------
    >>> rel_err([1.0, 2.0], [1.0, 2.0])
    0.0
    >>> rel_err([float("nan")], [1.0])
    inf
    """
    xp = import_cupy() if is_cupy_array(out) or is_cupy_array(ref) else numpy
    out = xp.asarray(out, dtype=numpy.float64)
    ref = xp.asarray(ref, dtype=numpy.float64)
    if bool(xp.isnan(out).any()) and not bool(xp.isnan(ref).any()):
        return float("inf")
    return float(xp.linalg.norm(out - ref)) / max(float(xp.linalg.norm(ref)), 1e-300)


@dataclasses.dataclass(frozen=True)
class Case:
    """One pipeline at one size: inputs, the cufused call, the PyTorch equivalent and its cost."""

    name: str
    pipeline: str
    shapes: dict  # array name -> shape (inputs and parameters)
    options: dict  # keyword options of the cufused pipeline
    conv: dict  # the convolution inside: kind, x shape (after any pooling), weight shape, options

    def make_inputs(self, rng: numpy.random.Generator) -> dict:
        """Float32 NumPy inputs: ``x`` and the norm / scale parameters uniform [0, 1) as the
        benchmark suites draw them; convolution weights and biases from PyTorch's default
        init, uniform in +-1/sqrt(fan_in) (all-positive weights would saturate C's clamp)."""
        fan_in = numpy.prod(self.shapes["weight"][1:])
        bound = 1.0 / numpy.sqrt(fan_in)
        inputs = {}
        for k, s in self.shapes.items():
            if k in ("weight", "conv_bias"):
                inputs[k] = rng.uniform(-bound, bound, s).astype(numpy.float32)
            else:
                inputs[k] = rng.random(s, dtype=numpy.float32)
        return inputs

    def reference(self, arrays: dict):
        """The pipeline computed by :mod:`cufused.reference` in float64 on ``arrays`` (NumPy or
        CuPy arrays keyed as ``shapes``; on CuPy arrays it runs on the GPU)."""
        o, a = self.options, arrays
        if self.name == "A":
            k = o["pool_kernel"]
            return reference.conv2d_groupnorm_scale_maxpool_clamp(
                a["x"], a["weight"], a["conv_bias"], a["gn_weight"], a["gn_bias"], a["scale"],
                num_groups=o["num_groups"], pool_kernel=(k, k), clamp_min=o["clamp_min"],
                clamp_max=o["clamp_max"], stride=(1, 1), padding=(0, 0), eps=1e-5)
        if self.name == "B":
            s, p = o["stride"], o["padding"]
            return reference.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
                a["x"], a["weight"], a["bn_weight"], a["bn_bias"], a["gn_weight"], a["gn_bias"],
                num_groups=o["num_groups"], stride=(s, s), padding=(p, p), output_padding=(0, 0),
                groups=1, conv_bias=None, pool_kernel=(2, 2), eps=1e-5, running_mean=None,
                running_var=None, momentum=0.1)
        s, p, op, k = (o[key] for key in ("stride", "padding", "output_padding", "pool_kernel"))
        return reference.conv_transpose3d_avgpool_clamp_softmax_multiply(
            a["x"], a["weight"], a["scale"], stride=(s,) * 3, padding=(p,) * 3,
            output_padding=(op,) * 3, pool_kernel=(k,) * 3, clamp_min=o["clamp_min"],
            clamp_max=o["clamp_max"], conv_bias=None, groups=1)

    def run_cufused(self, inputs: dict, *, precision: str, method: str = "fused", out=None):
        """Run the pipeline on CuPy copies of ``inputs`` (cached on the dict)."""
        gpu = on_gpu(inputs)
        return getattr(cufused, self.pipeline)(*gpu.values(), **self.options,
                                               precision=precision, method=method, out=out)

    def conv_flops(self) -> float:
        c = self.conv
        w = c["w_shape"]
        if c["kind"] == "fprop":
            return 2.0 * numpy.prod(c["y_shape"]) * numpy.prod(w[1:])
        return 2.0 * numpy.prod(c["x_shape"]) * numpy.prod(w[1:])  # each input value scatters

    def io_bytes(self) -> float:
        """Pipeline input read once plus output written once (float32)."""
        return 4.0 * (numpy.prod(self.shapes["x"]) + numpy.prod(self.output_shape))

    def post_conv_bytes(self) -> float:
        """What the pipeline moves besides the convolution (float32): the conv output read once
        plus the pipeline output written once, and where the input is pooled before the conv
        (C), the input read once plus the conv input written once."""
        moved = numpy.prod(self.conv["y_shape"]) + numpy.prod(self.output_shape)
        if tuple(self.conv["x_shape"]) != tuple(self.shapes["x"]):
            moved += numpy.prod(self.shapes["x"]) + numpy.prod(self.conv["x_shape"])
        return 4.0 * moved

    @property
    def output_shape(self) -> tuple[int, ...]:
        return tuple(self.conv["out_shape"])


def on_gpu(inputs: dict) -> dict:
    """CuPy copies of ``inputs`` (those not keyed ``_...``), made once and kept as ``_gpu``."""
    import cupy

    cached = inputs.get("_gpu")
    if cached is None:
        cached = {k: cupy.asarray(v) for k, v in inputs.items() if not k.startswith("_")}
        inputs["_gpu"] = cached
    return cached


def make_cases(small: bool = False, batch: int | None = None) -> list[Case]:
    """The three canonical cases of the design (KernelBench level 2 shapes), or small ones;
    ``batch`` replaces each case's batch size."""
    if small:
        na, nb, nc, hw_a, hw_b, dhw_c = 8, 16, 2, 64, 16, (16, 32, 32)
    else:
        na, nb, nc, hw_a, hw_b, dhw_c = 128, 512, 32, 128, 32, (32, 64, 64)
    if batch is not None:
        na = nb = nc = batch
    ha = hw_a - 2
    hb = hw_b + 2
    pc = tuple(s // 2 for s in dhw_c)
    oc = tuple(2 * s for s in pc)
    return [
        Case("A", "conv2d_groupnorm_scale_maxpool_clamp",
             shapes=dict(x=(na, 8, hw_a, hw_a), weight=(64, 8, 3, 3), conv_bias=(64,),
                         gn_weight=(64,), gn_bias=(64,), scale=(64, 1, 1)),
             options=dict(num_groups=16, pool_kernel=4, clamp_min=0.0, clamp_max=1.0),
             conv=dict(kind="fprop", x_shape=(na, 8, hw_a, hw_a), w_shape=(64, 8, 3, 3),
                       y_shape=(na, 64, ha, ha), out_shape=(na, 64, ha // 4, ha // 4))),
        Case("B", "conv_transpose2d_batchnorm_tanh_maxpool_groupnorm",
             shapes=dict(x=(nb, 64, hw_b, hw_b), weight=(64, 128, 5, 5), bn_weight=(128,),
                         bn_bias=(128,), gn_weight=(128,), gn_bias=(128,)),
             options=dict(num_groups=8, stride=1, padding=1),
             conv=dict(kind="dgrad", x_shape=(nb, 64, hw_b, hw_b), w_shape=(64, 128, 5, 5),
                       y_shape=(nb, 128, hb, hb), out_shape=(nb, 128, hb // 2, hb // 2))),
        Case("C", "conv_transpose3d_avgpool_clamp_softmax_multiply",
             shapes=dict(x=(nc, 32, *dhw_c), weight=(32, 64, 3, 3, 3), scale=(1, 64, 1, 1, 1)),
             options=dict(stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=0.0,
                          clamp_max=1.0),
             conv=dict(kind="dgrad", x_shape=(nc, 32, *pc), w_shape=(32, 64, 3, 3, 3),
                       y_shape=(nc, 64, *oc), out_shape=(nc, 64, *oc))),
    ]


CASES = make_cases()


def torch_pipeline(case: Case) -> Callable:
    """The PyTorch (functional) equivalent of a case's pipeline, on torch tensors."""
    import torch
    import torch.nn.functional as F

    o = case.options
    if case.name == "A":
        def run(x, weight, conv_bias, gn_weight, gn_bias, scale):
            y = F.conv2d(x, weight, conv_bias)
            y = F.group_norm(y, o["num_groups"], gn_weight, gn_bias) * scale
            y = F.max_pool2d(y, o["pool_kernel"])
            return torch.clamp(y, o["clamp_min"], o["clamp_max"])
    elif case.name == "B":
        def run(x, weight, bn_weight, bn_bias, gn_weight, gn_bias):
            y = F.conv_transpose2d(x, weight, stride=o["stride"], padding=o["padding"])
            y = torch.tanh(F.batch_norm(y, None, None, bn_weight, bn_bias, training=True))
            y = F.max_pool2d(y, 2, 2)
            return F.group_norm(y, o["num_groups"], gn_weight, gn_bias)
    else:
        def run(x, weight, scale):
            y = F.avg_pool3d(x, o["pool_kernel"])
            y = F.conv_transpose3d(y, weight, stride=o["stride"], padding=o["padding"],
                                   output_padding=o["output_padding"])
            y = torch.clamp(y, o["clamp_min"], o["clamp_max"])
            n, c = y.shape[:2]
            y = torch.softmax(y.view(n, c, -1), dim=2).view(y.shape)
            return y * scale
    return run


def torch_reference(case: Case, inputs: dict) -> numpy.ndarray:
    """The case computed by PyTorch on CUDA in float64 (an oracle for the canonical sizes)."""
    import torch

    args = [torch.from_numpy(numpy.asarray(v, dtype=numpy.float64)).cuda()
            for k, v in inputs.items() if not k.startswith("_")]
    with torch.no_grad():
        return torch_pipeline(case)(*args).cpu().numpy()
