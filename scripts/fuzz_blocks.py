"""Random shapes and options of the building blocks on the GPU against the float64 reference
(device).

The blocks are the convolutions (``conv2d``, ``conv3d``, ``conv_transpose2d``,
``conv_transpose3d``), ``group_norm``, ``batch_norm``, the pools (``max_pool2d``,
``max_pool3d``, ``avg_pool2d``, ``avg_pool3d``) and ``softmax``. Each case draws only what
they document: the batch (1 to 3, now and then empty; a convolution's input now and then
unbatched), channels (any count), groups, spatial sizes (1 among them), kernel, stride,
padding (also ``"same"``), dilation and output padding (an int, a one-value sequence or one
value per dimension), the bias and the affine parameters (None or
arrays in one of the per-channel layouts), eps, ``batch_norm``'s mode (training or inference,
with or without running buffers, momentum 0 to 1, a fused tanh or none), the pools' stride
(None, ``()`` or values) and padding, ``softmax``'s axis (an int or a tuple, negative ones
too), an offset of the input (means far from zero), the layout of the input and weight
(contiguous, channels-last or with the last two axes swapped), and for the convolutions the
precision and engine (cufused's implicit GEMM forced, or the autotuner's choice; a fifth of
the ``conv_transpose3d`` draws take pipeline C's form, which that engine computes). The block
runs on CuPy float32 copies: twice without ``out`` (a first and a warm call), then twice into
``out`` (a NaN-filled array, for the convolutions contiguous or packed channels-last, or for
the blocks that allow it ``x`` itself); each result, and
each running buffer that ``batch_norm`` updates, is compared with the same public function on
the float64 NumPy arrays (the reference path): the shape, the dtype (the input's), and the
relative norm error under 5e-3 for ``"tf32"`` (2e-2 with an offset input), 1e-4 otherwise
(3e-4 with an offset input), as scripts/fuzz_pipelines.py holds the pipelines; ``out`` must be
the array returned, and the first result must keep its values through the later calls. A
draw that the reference rejects (``ValueError``) is skipped and counted. Each failure (an
exception too) prints its case and the command that replays it, ``--blocks NAME --case
SEED``; the exit status is 1 if any case failed.

With ``--nonfinite``, each case plants one to three NaN, +inf or -inf values at random
positions of random array arguments (input, weight, bias, norm parameters, running buffers)
and compares with PyTorch in float64 on the CPU (``torch.nn.functional``): the NaN, +inf and
-inf positions must be the same, the finite values within the tolerances above, the GPU
convolutions' included (a non-finite weight or input by the definition on every engine,
docs/semantics.rst). The NumPy path is held to the same positions and to 1e-9. With ``--cpu``,
only the NumPy
path runs, with the layouts and ``out`` above, against PyTorch float64 at 1e-9 (no GPU needed).

Usage: python scripts/fuzz_blocks.py [--seed 1] [--seconds 60] [--blocks conv2d ...]
                                     [--nonfinite] [--cpu] [--case SEED]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from fuzz_pipelines import (_per_channel, _placement_error, _plant, _to_gpu,  # scripts/
                            channel_affine, group_norm_as)

import cufused
from cufused._arrays import is_cupy_array
from cufused._settings import plan_options
from cufused._ops.normalization import torch_cuda_native_form

CONVOLUTIONS = ("conv2d", "conv3d", "conv_transpose2d", "conv_transpose3d")
# The blocks whose out may be exactly x (in place).
IN_PLACE = ("group_norm", "batch_norm", "softmax")
# Running buffers that batch_norm updates in place, compared after each call.
BUFFERS = ("running_mean", "running_var")


def _option(rng: np.random.Generator, values: list[int]) -> int | tuple[int, ...]:
    """A per-dimension option as one int or a one-value sequence (where every dimension has
    the same value), or one value per dimension."""
    if len(set(values)) == 1:
        form = rng.random()
        if form < 0.5:
            return values[0]
        if form < 0.6:
            return (values[0],)
    return tuple(values)


def _channel_param(rng: np.random.Generator, c: int, ndim: int,
                   values: np.ndarray | None = None) -> np.ndarray | None:
    """``values`` (else fuzz_pipelines' draw: None or a per-channel array) in one of the
    documented per-channel layouts against an (N, C, ...) input of ``ndim`` dimensions."""
    if values is None:
        values = _per_channel(rng, c)
        if values is None:
            return None
    shapes = [(c,), (1, c) + (1,) * (ndim - 2)]
    if ndim > 2:
        shapes.append((c,) + (1,) * (ndim - 2))
    return values.reshape(shapes[int(rng.integers(len(shapes)))])


def _batch(rng: np.random.Generator, most: int = 3) -> int:
    """1 to ``most`` samples, now and then none (an empty batch)."""
    return 0 if rng.random() < 0.03 else int(rng.integers(1, most + 1))


def _spatial(rng: np.random.Generator, count: int, most: int) -> list[int]:
    return [int(rng.integers(1, most + 1)) for _ in range(count)]


def _conv(rng: np.random.Generator, nd: int, transposed: bool) -> tuple[list, dict]:
    groups = int(rng.choice([1, 1, 1, 2, 3, 4]))
    cin, cout = groups * int(rng.integers(1, 7)), groups * int(rng.integers(1, 7))
    kernel = [int(rng.choice([1, 2, 3, 3, 4, 5] if nd == 2 else [1, 2, 3, 3])) for _ in range(nd)]
    stride = [int(rng.choice([1, 1, 2, 3])) for _ in range(nd)]
    dilation = [int(rng.choice([1, 1, 1, 2, 3])) for _ in range(nd)]
    c_form = nd == 3 and transposed and rng.random() < 0.2
    if c_form:
        # Pipeline C's form, which cufused's implicit GEMM takes at a tensor-core precision
        # (conv_transpose3d_s2k3): one group, 3 x 3 x 3, stride 2, padding 1, dilation 1.
        groups, kernel, stride, dilation = 1, [3] * 3, [2] * 3, [1] * 3
        cin, cout = int(rng.integers(1, 33)), int(rng.integers(1, 41))
    reach = [d * (k - 1) for d, k in zip(dilation, kernel)]
    options: dict[str, Any] = dict(stride=_option(rng, stride), dilation=_option(rng, dilation),
                                   groups=groups)
    if transposed:
        # Padding up to the kernel's reach crops the output, sometimes to nothing (rejected):
        # mostly up to half of it.
        padding = [1] * 3 if c_form else [
            int(rng.integers(0, (r if rng.random() < 0.3 else r // 2) + 1)) for r in reach]
        size = _spatial(rng, nd, 8 if nd == 2 else 4)
        options["output_padding"] = _option(
            rng, [int(rng.integers(0, max(s, d))) if rng.random() < 0.5 else 0
                  for s, d in zip(stride, dilation)])
        w_shape = (cin, cout // groups, *kernel)
    else:
        padding = [int(rng.integers(0, 3)) for _ in range(nd)]
        size = [max(1, r + 1 - 2 * p) + int(rng.integers(0, 14 if nd == 2 else 6))
                for r, p in zip(reach, padding)]
        w_shape = (cout, cin // groups, *kernel)
    options["padding"] = _option(rng, padding)
    if not transposed and stride == [1] * nd and rng.random() < 0.2:
        options["padding"] = "same"  # an odd reach puts its extra zero after the input
    x = rng.standard_normal((_batch(rng), cin, *size))
    if len(x) and rng.random() < 0.1:
        x = x[0]  # unbatched, as PyTorch takes it
    w = rng.standard_normal(w_shape) * 0.3
    return [x, w, _channel_param(rng, cout, nd + 2)], options


def _large_or_small(rng: np.random.Generator, most: int) -> list[int]:
    """Spatial sizes: now and then 2-D planes whose rows outgrow the normalization kernels'
    shared-memory row cache (their split path), else 0 to 3 small dimensions."""
    if rng.random() < 0.15:
        return [int(rng.integers(56, 100)), int(rng.integers(56, 100))]
    return _spatial(rng, int(rng.integers(0, 4)), most)


def _group_norm(rng: np.random.Generator) -> tuple[list, dict]:
    groups = int(rng.choice([1, 2, 3, 4, 8]))
    c = groups * int(rng.integers(1, 5))
    x = rng.standard_normal((_batch(rng), c, *_large_or_small(rng, 8)))
    bias = _channel_param(rng, c, x.ndim)
    if math.prod(x.shape[1:]) == groups:
        # One value per sample and group normalizes to exactly 0: the result is the bias, up
        # to the rounding of a * x + b (PyTorch's form, on both paths), whose terms cancel.
        # A bias away from 0 keeps that rounding small against the result (a relative error).
        bias = _channel_param(rng, c, x.ndim,
                              rng.uniform(0.5, 1.5, c) * rng.choice([-1.0, 1.0], c))
    return ([x, groups, _channel_param(rng, c, x.ndim), bias],
            dict(eps=float(rng.choice([1e-5, 1e-5, 1e-3, 0.1, 0.0]))))


def _batch_norm(rng: np.random.Generator) -> tuple[list, dict]:
    c = int(rng.integers(1, 10))
    x = rng.standard_normal((_batch(rng), c, *_large_or_small(rng, 6)))
    training = bool(rng.random() < 0.6)
    # eps > 0: PyTorch 2.13 refuses eps = 0 in training (docs/semantics.rst).
    options: dict[str, Any] = dict(
        training=training, momentum=float(rng.choice([0.1, 0.0, 1.0, rng.random()])),
        eps=float(rng.choice([1e-5, 1e-3, 0.1])), activation=rng.choice([None, "tanh"]))
    if not training or rng.random() < 0.5:  # inference requires the running buffers
        options["running_mean"] = _channel_param(rng, c, x.ndim, rng.standard_normal(c))
        options["running_var"] = _channel_param(rng, c, x.ndim, rng.random(c) + 0.5)
    return [x, _channel_param(rng, c, x.ndim), _channel_param(rng, c, x.ndim)], options


def _pool(rng: np.random.Generator, nd: int) -> tuple[list, dict]:
    kernel = [int(rng.choice([1, 2, 2, 3, 3, 4, 5] if nd == 2 else [1, 2, 2, 3]))
              for _ in range(nd)]
    padding = [int(rng.integers(0, k // 2 + 1)) for k in kernel]
    size = [k + int(rng.integers(0, 12 if nd == 2 else 6)) for k in kernel]
    if rng.random() < 0.2:  # smaller than the window: rejected unless the padding makes up
        size[int(rng.integers(nd))] = max(1, min(size) - 2)
    draw = rng.random()
    stride = (None if draw < 0.25 else () if draw < 0.3 else
              _option(rng, [int(rng.choice([1, 2, 3, k])) for k in kernel]))
    x = rng.standard_normal((_batch(rng), int(rng.integers(1, 7)), *size))
    return [x, _option(rng, kernel)], dict(stride=stride, padding=_option(rng, padding))


def _softmax(rng: np.random.Generator) -> tuple[list, dict]:
    if rng.random() < 0.1:  # long rows, which the GPU splits across blocks
        shape = [_batch(rng, 2), int(rng.integers(1, 4)), *_spatial(rng, 3, 40)]
    else:
        shape = _spatial(rng, int(rng.integers(1, 6)), 7)
        if rng.random() < 0.03:
            shape[int(rng.integers(len(shape)))] = 0
    ndim = len(shape)
    x = rng.standard_normal(shape) * float(rng.choice([1.0, 1.0, 10.0]))
    if rng.random() < 0.5:
        axis: int | tuple[int, ...] = int(rng.integers(-ndim, ndim))
    else:
        axes = rng.choice(ndim, int(rng.integers(1, ndim + 1)), replace=False)
        axis = tuple(int(a) - ndim if rng.random() < 0.3 else int(a) for a in axes)
    return [x], dict(axis=axis)


BLOCKS = {
    "conv2d": lambda rng: _conv(rng, 2, False),
    "conv3d": lambda rng: _conv(rng, 3, False),
    "conv_transpose2d": lambda rng: _conv(rng, 2, True),
    "conv_transpose3d": lambda rng: _conv(rng, 3, True),
    "group_norm": _group_norm,
    "batch_norm": _batch_norm,
    "max_pool2d": lambda rng: _pool(rng, 2),
    "max_pool3d": lambda rng: _pool(rng, 3),
    "avg_pool2d": lambda rng: _pool(rng, 2),
    "avg_pool3d": lambda rng: _pool(rng, 3),
    "softmax": _softmax,
}


def _batch_norm_centered(x, weight, bias, options: dict):
    """PyTorch CUDA's native BatchNorm, ``(x - mean) * rstd * weight + bias`` (float64 torch
    tensors), with the batch's statistics in training and the running ones otherwise."""
    import torch

    per_channel = (1, -1) + (1,) * (x.ndim - 2)
    if options["training"]:
        axes = [0, *range(2, x.ndim)]
        mean = x.mean(dim=axes, keepdim=True)
        var = x.var(dim=axes, unbiased=False, keepdim=True)
    else:
        mean = torch.from_numpy(np.array(options["running_mean"])).reshape(per_channel)
        var = torch.from_numpy(np.array(options["running_var"])).reshape(per_channel)
    return channel_affine((x - mean) * (1.0 / torch.sqrt(var + options["eps"])), weight, bias)


def _torch_outputs(block: str, args: list, options: dict, *,
                   gpu: bool = False) -> list[np.ndarray]:
    """The block in PyTorch, float64 on the CPU: its result, then the running buffers it
    updates (flattened). With ``gpu``, the normalizations take the GPU path's form for
    non-finite coefficients where PyTorch CUDA's kernel rules give the centered one
    (``group_norm_as``; BatchNorm's ``torch_cuda_native_form``)."""
    import torch
    import torch.nn.functional as F

    def t(value):
        # A copy: PyTorch updates the running buffers in place.
        return torch.from_numpy(np.array(value)) if isinstance(value, np.ndarray) else value

    def flat(value):
        return None if value is None else t(value).reshape(-1)

    with torch.no_grad():
        if block in CONVOLUTIONS:
            x, w, b = args
            return [getattr(F, block)(t(x), t(w), flat(b), **options).numpy()]
        if block == "group_norm":
            x, groups, w, b = args
            return [group_norm_as(t(x), groups, flat(w), flat(b), gpu=gpu,
                                  eps=options["eps"]).numpy()]
        if block == "batch_norm":
            x, w, b = args
            buffers = [flat(options[k]) for k in BUFFERS if k in options]
            y = F.batch_norm(t(x), *(buffers or (None, None)), flat(w), flat(b),
                             training=options["training"], momentum=options["momentum"],
                             eps=options["eps"])
            if gpu and torch_cuda_native_form(x.shape, w, b, options["training"]):
                y = _batch_norm_centered(t(x), flat(w), flat(b), options)
            if options["activation"] == "tanh":
                y = torch.tanh(y)
            return [y.numpy()] + [buf.numpy() for buf in buffers]
        if block == "softmax":
            x = t(args[0])
            axis = options["axis"]
            axes = sorted({a % x.ndim for a in (axis if isinstance(axis, tuple) else (axis,))})
            kept = [a for a in range(x.ndim) if a not in axes]
            moved = x.permute(*kept, *axes)
            rows = moved.reshape(*moved.shape[:len(kept)],
                                 math.prod(x.shape[a] for a in axes))
            y = torch.softmax(rows, dim=-1).reshape(moved.shape)
            return [y.permute(*np.argsort(kept + axes).tolist()).numpy()]
        return [getattr(F, block)(t(args[0]), args[1], **options).numpy()]


def _xp(value: Any) -> Any:
    """The array module of ``value``: CuPy for a CuPy array, else NumPy."""
    return sys.modules["cupy"] if is_cupy_array(value) else np


def _laid_out(value: Any, layout: str) -> Any:
    """``value`` (NumPy or CuPy) with the same values in another memory layout."""
    if layout == "dense" or value is None:
        return value
    xp = _xp(value)
    if layout == "channels_last":
        return xp.moveaxis(xp.ascontiguousarray(xp.moveaxis(value, 1, -1)), -1, 1)
    return xp.ascontiguousarray(value.swapaxes(-1, -2)).swapaxes(-1, -2)


def _host(value: Any) -> np.ndarray:
    return value.get() if hasattr(value, "get") else np.asarray(value)


def _runs(fn: Callable, args: list, options: dict, extra: dict, *, repeat: int,
          into_x: bool, out_layout: str = "dense") -> list[tuple[str, list, str | None]]:
    """``repeat`` calls of ``fn`` without ``out``, then ``repeat`` into ``out`` (NaN-filled in
    ``out_layout``, or ``x`` itself with ``into_x``): (label, the result and the updated
    running buffers on the
    host, what is wrong with the returned array or None) each. The running buffers (and with
    ``into_x``, ``x``) are reset in place before each call, so that the warm calls see the
    operands of the first at the same addresses. The first result must still hold its values
    after the other calls (a result is an array of its own, never a buffer that a later call
    reuses)."""
    x = args[0]
    xp = _xp(x)
    buffers = [k for k in BUFFERS if k in options]
    initial = {k: options[k].copy() for k in buffers}
    saved_x = x.copy() if into_x else None
    out = first = None
    runs = []
    for i in range(2 * repeat):
        for k in buffers:
            options[k][...] = initial[k]
        if i < repeat:
            label = "call"
            y = fn(*args, **options, **extra)
            first = y if first is None else first
        elif into_x:
            label = "into x"
            x[...] = saved_x
            out = x
            y = fn(*args, **options, **extra, out=out)
        else:
            label = "out"
            if out is None:  # allocated once: the warm call gets the same out
                out = _laid_out(xp.empty(runs[0][1][0].shape, dtype=x.dtype), out_layout)
            out.fill(np.nan)
            y = fn(*args, **options, **extra, out=out)
        problem = None
        if type(y) is not type(x) or y.dtype != x.dtype:
            problem = (f"returned {type(y).__name__} of {y.dtype}, not {type(x).__name__} "
                       f"of {x.dtype}")
        elif out is not None and y is not out:
            problem = "did not return out"
        runs.append((f"{label} {i % repeat + 1}",
                     [_host(y), *(_host(options[k]).reshape(-1) for k in buffers)], problem))
    if not np.array_equal(_host(first), runs[0][1][0], equal_nan=True):
        runs.append(("call 1", [], "its result changed in the later calls"))
    return runs


def _larger(a: tuple[float, str], b: tuple[float, str]) -> tuple[float, str]:
    """The larger of two (error ratio, where) pairs; a NaN ratio is the largest."""
    return a if math.isnan(a[0]) or a[0] >= b[0] else b


def _worst(runs: list, refs: list[np.ndarray], tol: float) -> tuple[float, str]:
    """The largest error / ``tol`` of ``runs`` (see :func:`_runs`) against ``refs`` (the
    result and the running buffers), and where it is."""
    worst = (0.0, "")
    names = ["result", *BUFFERS]
    for label, outputs, problem in runs:
        if problem is not None:
            return float("inf"), f"{label}: {problem}"
        for name, out, ref in zip(names, outputs, refs):
            if out.shape != ref.shape:
                return float("inf"), f"{label} {name}: shape {out.shape}, expected {ref.shape}"
            worst = _larger(worst, (_placement_error(out, ref) / tol, f"{label} {name}"))
    return worst


def _tolerance(precision: str | None, offset: float) -> float:
    # An offset input keeps its spread in fewer bits (fuzz_pipelines.run_case says why).
    if precision == "tf32":
        return 2e-2 if offset else 5e-3
    return 3e-4 if offset else 1e-4


def _with_buffer_copies(options: dict) -> dict:
    """``options`` with copies of the running buffers, which a call updates in place."""
    return {k: np.copy(v) if k in BUFFERS else v for k, v in options.items()}


def run_case(block: str, seed: int, *, nonfinite: bool = False,
             gpu: bool = True) -> tuple[dict, float, str] | None:
    """The case ``seed`` of ``block``: (draw, worst error / tolerance, where it is), or None
    where the draw is rejected."""
    rng = np.random.default_rng(seed)
    args, options = BLOCKS[block](rng)
    offset = float(rng.choice([0.0, 0.0, 0.0, 20.0, -20.0]))
    args[0] = args[0] + offset
    layout = str(rng.choice(["dense", "dense", "channels_last", "transposed"]))
    if args[0].ndim < 3:
        layout = "dense" if args[0].ndim < 2 else "transposed"
    into_x = block in IN_PLACE and layout == "dense" and bool(rng.random() < 0.5)
    extra, engine, out_layout = {}, None, "dense"
    if block in CONVOLUTIONS:
        extra["precision"] = rng.choice([None, "ieee", "tf32", "3xtf32"])
        engine = str(rng.choice(["igemm", "auto"]))
        # An unbatched input's out is dense (channels-last has a batch axis).
        if args[0].ndim == args[1].ndim:
            out_layout = str(rng.choice(["dense", "channels_last"]))
    planted = []
    if nonfinite and args[0].size:  # an empty x leaves nothing to plant in (or to spread to)
        args, options, planted = _plant(rng, args, options)
    fn = getattr(cufused, block)
    ref_options = _with_buffer_copies(options)
    try:  # the reference path, on dense float64 arrays
        ref = fn(*args, **ref_options, **extra)
    except ValueError:
        return None
    refs = [ref, *(ref_options[k].reshape(-1) for k in BUFFERS if k in options)]
    draw = dict(shapes=[getattr(a, "shape", a) for a in args],
                options={k: getattr(v, "shape", v) for k, v in options.items()},
                offset=offset, layout=layout, out_layout=out_layout, into_x=into_x, **extra)
    if engine is not None:
        draw["engine"] = engine
    if planted:
        draw["planted"] = planted
    # The arguments that the layout rearranges: x, and a convolution's weight.
    laid_out = (0, 1) if block in CONVOLUTIONS else (0,)
    if not gpu:
        torch_refs = _torch_outputs(block, args, options)  # before x is written in place
        cpu_args = [_laid_out(a, layout) if i in laid_out else a for i, a in enumerate(args)]
        runs = _runs(fn, cpu_args, _with_buffer_copies(options), extra, repeat=1,
                     into_x=into_x, out_layout=out_layout)
        return draw, *_worst(runs, torch_refs, 1e-9)
    worst = (0.0, "")
    if nonfinite:
        torch_refs = _torch_outputs(block, args, options)
        worst = _worst([("reference", refs, None)], torch_refs, 1e-9)
        refs = _torch_outputs(block, args, options, gpu=True)
    gpu_args = [_laid_out(_to_gpu(a), layout) if i in laid_out else _to_gpu(a)
                for i, a in enumerate(args)]
    gpu_options = {k: _to_gpu(v) for k, v in options.items()}
    with plan_options(engine=engine):
        runs = _runs(fn, gpu_args, gpu_options, extra, repeat=2, into_x=into_x,
                     out_layout=out_layout)
    tol = _tolerance(extra.get("precision"), offset)
    return draw, *_larger(worst, _worst(runs, refs, tol))


def _context_lost() -> bool:
    """Whether this process's CUDA context has ended (a kernel faulted: every call fails)."""
    import cupy

    try:
        cupy.cuda.runtime.deviceSynchronize()
    except cupy.cuda.runtime.CUDARuntimeError:
        return True
    return False


def _cases(args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    """(block, case seed) pairs: the one case of ``--case``, else random ones for
    ``--seconds``."""
    if args.case is not None:
        yield args.blocks[0], args.case
        return
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        yield str(rng.choice(args.blocks)), int(rng.integers(2**31))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", nargs="*", choices=sorted(BLOCKS), default=sorted(BLOCKS),
                        help="the blocks to fuzz (all)")
    parser.add_argument("--nonfinite", action="store_true",
                        help="plant NaN / inf values and compare with PyTorch float64")
    parser.add_argument("--cpu", action="store_true",
                        help="the NumPy path only, against PyTorch float64 (no GPU)")
    parser.add_argument("--seed", type=int, default=1, help="random seed (1)")
    parser.add_argument("--seconds", type=float, default=60.0, help="time to run (60)")
    parser.add_argument("--case", type=int, metavar="SEED",
                        help="replay the case SEED of the one block of --blocks (verbose)")
    args = parser.parse_args(argv)
    if args.case is not None and len(args.blocks) != 1:
        parser.error("--case replays the case of one block: name it with --blocks")
    if args.nonfinite or args.cpu:
        import torch

        # The tensors are small: PyTorch's threads only spin against NumPy's (3 to 6 times
        # fewer cases ran on 2 cores with them).
        torch.set_num_threads(1)
    ran = {name: 0 for name in args.blocks}
    rejected = {name: 0 for name in args.blocks}
    failed = 0
    flags = " --nonfinite" * args.nonfinite + " --cpu" * args.cpu
    for block, seed in _cases(args):
        replay = f"python scripts/fuzz_blocks.py --blocks {block} --case {seed}{flags}"
        try:
            result = run_case(block, seed, nonfinite=args.nonfinite, gpu=not args.cpu)
        except Exception as exc:  # counted, and the run goes on; the replay raises it
            if args.case is not None:
                raise
            failed += 1
            ran[block] += 1
            print(f"FAIL {block}: {type(exc).__name__}: {exc}; replay: {replay}", flush=True)
            if not args.cpu and _context_lost():
                print("the device faulted and its CUDA context is lost: every later case "
                      "would fail, so the run stops (the fault may be an earlier kernel's: "
                      "replay with CUDA_LAUNCH_BLOCKING=1)", flush=True)
                break
            continue
        if result is None:
            rejected[block] += 1
            continue
        draw, ratio, where = result
        ran[block] += 1
        if not ratio < 1.0:  # NaN fails too
            failed += 1
            print(f"FAIL {block}: error {ratio:.2f}x the tolerance at {where}, {draw}; "
                  f"replay: {replay}", flush=True)
        elif args.case is not None:
            print(f"ok {block}: error {ratio:.2g}x the tolerance at {where}, {draw}")
    print(f"rejected draws: {sum(rejected.values())} of "
          f"{sum(rejected.values()) + sum(ran.values())} {rejected}")
    print(f"cases run: {ran}; failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
