"""Random shapes and options of the three pipelines on the GPU against the float64 reference
(device).

Each case draws the batch, channels, groups, spatial sizes, kernel, stride, padding and pool,
the parameters' forms (per-channel arrays, a number or None where the pipeline allows it), an
offset of the input (means far from zero), the precision and the convolution engine
(cufused's implicit GEMM or DFT engine forced where it takes the problem, or the autotuner's
choice) and the clamp bounds (infinite ones among them). The call runs three times on CuPy
float32 copies (a first call and two warm ones, which the whole-call graphs may capture and
replay), and every result is compared with the same public function on the float64 NumPy arrays (the
reference path): relative norm error under 5e-3 for ``"tf32"`` (2e-2 with an offset input),
1e-4 for ``"ieee"`` and ``"3xtf32"`` (3e-4 with an offset input). A draw that the functions
reject (``ValueError``) is skipped. Each failure prints its case; the exit status is 1 if
any case failed.

With ``--nonfinite``, each case plants one to three NaN, +inf or -inf values at random
positions of random array arguments (input, weights, parameters) and compares with PyTorch in
float64 on the CPU, the definition's products only (PyTorch CUDA's float32 NaNs for an infinite
weight depend on its convolution algorithm): the NaN, +inf and -inf positions must be the same,
the finite values within the tolerances above. The NumPy path is held to the same positions and
to 1e-9. Pipeline C's GPU results leave out the positions whose float64 softmax is below
float32's smallest normal number (0 on the GPU, so an infinite scale gives NaN there; see
docs/semantics.rst); A's and B's leave out the channels of an infinite GroupNorm weight in a
group whose exact mean is 0, where PyTorch's own rounding of the mean decides between NaN and
an infinity. With ``--nonfinite --cpu``, only the NumPy path runs (no GPU needed).

Usage: python scripts/fuzz_pipelines.py [--seed 1] [--seconds 60] [--cases A B C]
                                        [--nonfinite] [--cpu]
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

import cufused
from cufused._settings import plan_options
from cufused.bench.cases import rel_err


def _per_channel(rng, c: int, *, number: bool = False, none: bool = True):
    """A parameter as a per-channel array (mixed signs), a number or None."""
    draw = rng.random()
    if none and draw < 0.2:
        return None
    if number and draw < 0.4:
        return float(rng.standard_normal())
    return rng.standard_normal(c)


INF = float("inf")
# Clamp bounds: infinite ones (no bound) and bounds past each other (clamp_max everywhere)
# beside the usual. C's stay bounded above, so that its softmax exponents stay small enough
# for the TF32 tolerance.
CLAMPS_A = [(-0.5, 0.8), (-0.5, 0.8), (-INF, INF), (0.0, INF), (-INF, 0.5), (0.8, -0.5)]
CLAMPS_C = [(0.0, 1.0), (0.0, 4.0), (-INF, 1.0), (1.0, 0.0)]


def _clamp(rng, choices) -> dict:
    lo, hi = choices[int(rng.integers(len(choices)))]
    return dict(clamp_min=lo, clamp_max=hi)


def _case_a(rng):
    groups = int(rng.choice([1, 2, 4, 8]))
    cin, cout = int(rng.integers(1, 12)), groups * int(rng.integers(1, 10))
    k, stride, pad = int(rng.choice([1, 3, 3, 5])), int(rng.choice([1, 1, 2])), int(
        rng.integers(0, 3))
    pool = int(rng.choice([2, 3, 4, 4]))
    h, w = int(rng.integers(k + pool, 70)), int(rng.integers(k + pool, 90))
    x = rng.random((int(rng.integers(1, 5)), cin, h, w))
    args = (x, rng.standard_normal((cout, cin, k, k)) * 0.3, _per_channel(rng, cout),
            rng.standard_normal(cout), _per_channel(rng, cout),
            _per_channel(rng, cout, number=True))
    return "conv2d_groupnorm_scale_maxpool_clamp", args, dict(
        num_groups=groups, pool_kernel=pool, stride=stride, padding=pad,
        **_clamp(rng, CLAMPS_A))


def _case_b(rng):
    groups, conv_groups = int(rng.choice([1, 2, 4])), int(rng.choice([1, 1, 2]))
    cin = conv_groups * int(rng.integers(1, 8))
    cout = conv_groups * groups * int(rng.integers(1, 5))
    k, stride = int(rng.choice([2, 3, 5])), int(rng.choice([1, 1, 2]))
    pad = int(rng.integers(0, k))
    x = rng.random((int(rng.integers(2, 6)), cin, int(rng.integers(3, 20)),
                    int(rng.integers(3, 20))))
    args = (x, rng.standard_normal((cin, cout // conv_groups, k, k)) * 0.3,
            rng.standard_normal(cout), _per_channel(rng, cout), rng.standard_normal(cout),
            _per_channel(rng, cout))
    return "conv_transpose2d_batchnorm_tanh_maxpool_groupnorm", args, dict(
        num_groups=groups, stride=stride, padding=pad,
        output_padding=int(rng.integers(0, stride)), groups=conv_groups,
        conv_bias=_per_channel(rng, cout))


def _case_c(rng):
    cin, cout = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    stride = int(rng.choice([1, 2, 2]))
    x = rng.random((int(rng.integers(1, 3)), cin, int(rng.integers(4, 12)),
                    int(rng.integers(4, 14)), int(rng.integers(4, 14))))
    args = (x, rng.standard_normal((cin, cout, 3, 3, 3)),
            rng.standard_normal(cout).reshape(1, cout, 1, 1, 1))
    return "conv_transpose3d_avgpool_clamp_softmax_multiply", args, dict(
        stride=stride, padding=1, output_padding=stride - 1, pool_kernel=2,
        conv_bias=_per_channel(rng, cout), **_clamp(rng, CLAMPS_C))


CASES = {"A": _case_a, "B": _case_b, "C": _case_c}


def channel_affine(z, weight, bias):
    """``z * weight + bias`` with per-channel (axis 1) ``weight`` and ``bias`` (either may be
    None) of torch tensors."""
    per_channel = (1, -1) + (1,) * (z.ndim - 2)
    if weight is not None:
        z = z * weight.reshape(per_channel)
    return z if bias is None else z + bias.reshape(per_channel)


def group_norm_as(y, num_groups, weight, bias, *, gpu: bool, eps: float = 1e-5):
    """PyTorch's GroupNorm in float64 on the CPU, in the form of the GPU path where ``gpu``:
    an input of one value per channel takes PyTorch CUDA's centered form
    ``(y - mean) * rstd * weight + bias`` (docs/semantics.rst), which PyTorch CPU's
    ``a * y + b`` departs from for non-finite coefficients."""
    import torch
    import torch.nn.functional as F

    if not gpu or math.prod(y.shape[2:]) != 1 or y.shape[0] == 0:  # (an empty batch: no rows)
        return F.group_norm(y, num_groups, weight, bias, eps=eps)
    rows = y.reshape(y.shape[0], num_groups, -1)
    mean = rows.mean(dim=2, keepdim=True)
    rstd = 1.0 / torch.sqrt(rows.var(dim=2, unbiased=False, keepdim=True) + eps)
    return channel_affine(((rows - mean) * rstd).reshape(y.shape), weight, bias)


def _torch_a(x, w, cb, gw, gb, scale, *, num_groups, pool_kernel, clamp_min, clamp_max,
             stride, padding, gpu=False):
    import torch
    import torch.nn.functional as F

    y = group_norm_as(F.conv2d(x, w, cb, stride=stride, padding=padding), num_groups, gw, gb,
                      gpu=gpu)
    if scale is not None:
        y = y * (scale.reshape(1, -1, 1, 1) if isinstance(scale, torch.Tensor) else scale)
    return F.max_pool2d(y, pool_kernel).clamp(clamp_min, clamp_max)


def _torch_b(x, w, bw, bb, gw, gb, *, num_groups, stride, padding, output_padding, groups,
             conv_bias, gpu=False):
    import torch
    import torch.nn.functional as F

    y = F.conv_transpose2d(x, w, conv_bias, stride=stride, padding=padding,
                           output_padding=output_padding, groups=groups)
    y = torch.tanh(F.batch_norm(y, None, None, bw, bb, training=True))
    return group_norm_as(F.max_pool2d(y, 2, 2), num_groups, gw, gb, gpu=gpu)


def _torch_c(x, w, scale, *, stride, padding, output_padding, pool_kernel, clamp_min,
             clamp_max, conv_bias, gpu=False):
    import torch
    import torch.nn.functional as F

    y = F.conv_transpose3d(F.avg_pool3d(x, pool_kernel), w, conv_bias, stride=stride,
                           padding=padding, output_padding=output_padding)
    y = y.clamp(clamp_min, clamp_max)
    n, c = y.shape[:2]
    return torch.softmax(y.reshape(n, c, -1), dim=2).reshape(y.shape) * scale


TORCH = {"A": _torch_a, "B": _torch_b, "C": _torch_c}

# The least magnitude per value that a pipeline's errors are taken relative to. A's and B's
# results are of the order of their GroupNorm's weight and bias (clamped in A), standard
# normal draws: a group whose exact result is its bias (one value, or values all equal after
# tanh saturates) leaves them 0 in the NumPy path and roundoff (~1e-14) in PyTorch's float64,
# whose relative error means nothing. C's softmax values are small by design: no floor.
SCALE_FLOOR = {"A": 1e-3, "B": 1e-3, "C": 0.0}


def _torch_reference(name: str, args, options, *, gpu: bool = False) -> np.ndarray:
    """The pipeline in PyTorch, float64 on the CPU (in the GPU path's forms where ``gpu``:
    :func:`group_norm_as`)."""
    import torch

    def t(value):
        return torch.from_numpy(value) if isinstance(value, np.ndarray) else value

    with torch.no_grad():
        return TORCH[name](*map(t, args), **{k: t(v) for k, v in options.items()},
                           gpu=gpu).numpy()


def _plant(rng, args, options):
    """Copies of ``args`` and ``options`` with one to three NaN / +inf / -inf values planted
    in random array arguments; the list of (argument, flat index, value) planted."""
    args = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    options = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in options.items()}
    slots = [(i, None) for i, a in enumerate(args) if isinstance(a, np.ndarray)]
    slots += [(None, k) for k, v in options.items() if isinstance(v, np.ndarray)]
    planted = []
    for _ in range(int(rng.integers(1, 4))):
        i, k = slots[int(rng.integers(len(slots)))]
        target = args[i] if k is None else options[k]
        at = int(rng.integers(target.size))
        value = float(rng.choice([np.nan, np.inf, -np.inf]))
        target.reshape(-1)[at] = value
        planted.append((i if k is None else k, at, value))
    return args, options, planted


def _placement_error(out, ref, ignore=None, *, floor: float = 0.0) -> float:
    """inf where the NaN, +inf or -inf positions of ``out`` and ``ref`` differ, else the
    relative error of the values finite in both (0 where there are none); positions where
    the boolean array ``ignore`` is set are left out. ``floor`` is the least magnitude per
    value that the error is taken relative to (:data:`SCALE_FLOOR`)."""
    out = np.asarray(out, dtype=np.float64)
    if ignore is not None:
        out, ref = out[~ignore], ref[~ignore]
    for test in (np.isnan, np.isposinf, np.isneginf):
        if not np.array_equal(test(out), test(ref)):
            return float("inf")
    finite = np.isfinite(ref)
    if not finite.any():
        return 0.0
    scale = max(float(np.linalg.norm(ref[finite])), floor * float(np.sqrt(finite.sum())))
    return float(np.linalg.norm(out[finite] - ref[finite])) / max(scale, 1e-300)


def _float32_underflow(name: str, args, options):
    """Pipeline C's positions whose float64 softmax is below float32's smallest normal
    number, where the GPU's value is 0 (denormals flush to zero) and an infinite scale gives
    NaN instead of the infinity (docs/semantics.rst); None for the other pipelines."""
    if name != "C":
        return None
    soft = _torch_reference(name, (*args[:2], np.ones_like(args[2])), options)
    return np.abs(soft) < np.finfo(np.float32).tiny


def _mean_decided_by_rounding(name: str, args, options, shape):
    """Pipelines A's and B's positions whose PyTorch value the rounding of its GroupNorm mean
    decides: the channels of infinite GroupNorm weight in a (sample, group) whose input has
    an exact mean of 0. There ``b = bias - mean * a`` (``a = rstd * weight`` infinite) is
    NaN for the exact mean, and PyTorch's own mean comes out as 0 or as a rounding error
    of either sign, so its values there are NaN or infinite by the group's size (half +1 and
    half -1 after B's tanh: NaN for 2 + 2 values, +inf for 6 + 6, NaN for 15 + 15;
    docs/semantics.rst), as a mask of the output's ``shape``. None where there are none,
    and for C."""
    if name == "C":
        return None
    import torch
    import torch.nn.functional as F

    t = [torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args]
    opts = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
            for k, v in options.items()}
    with torch.no_grad():
        if name == "A":
            y = F.conv2d(t[0], t[1], t[2], stride=opts["stride"], padding=opts["padding"])
            weight = args[3]
        else:
            y = F.conv_transpose2d(t[0], t[1], opts["conv_bias"], stride=opts["stride"],
                                   padding=opts["padding"],
                                   output_padding=opts["output_padding"],
                                   groups=opts["groups"])
            y = F.max_pool2d(torch.tanh(F.batch_norm(y, None, None, t[2], t[3],
                                                      training=True)), 2, 2)
            weight = args[4]
    if weight is None or not np.isinf(weight).any():
        return None
    groups = options["num_groups"]
    rows = y.numpy().reshape(y.shape[0], groups, -1)
    exact_zero = np.array([[np.isfinite(r).all() and math.fsum(r) == 0.0 for r in sample]
                           for sample in rows])  # fsum: the exact sum's rounding, 0 iff 0
    channel = np.repeat(exact_zero, y.shape[1] // groups, axis=1) & np.isinf(weight)
    return None if not channel.any() else np.broadcast_to(
        channel[:, :, None, None], shape).copy()


def _to_gpu(value):
    import cupy

    return cupy.asarray(value, dtype=cupy.float32) if isinstance(value, np.ndarray) else value


def run_case(rng, name: str, *, nonfinite: bool = False,
             gpu: bool = True) -> tuple[str, dict, float] | None:
    """One random case of pipeline ``name``: (description, draw, worst error / tolerance), or
    None where the draw is rejected."""
    pipeline, args, options = CASES[name](rng)
    offset = float(rng.choice([0.0, 0.0, 5.0]))
    args = (args[0] + offset,) + args[1:]
    precision = str(rng.choice(["ieee", "tf32", "3xtf32"]))
    engine = str(rng.choice(["igemm", "fft", "auto"]))
    planted = None
    if nonfinite:
        args, options, planted = _plant(rng, args, options)
    fn = getattr(cufused, pipeline)
    try:
        ref = fn(*args, **options)
    except ValueError:
        return None
    draw = dict(shapes=[getattr(a, "shape", a) for a in args],
                options={k: getattr(v, "shape", v) for k, v in options.items()},
                offset=offset, precision=precision, engine=engine)
    errors = []
    ignore = None
    if nonfinite:
        draw["planted"] = planted
        torch_ref = _torch_reference(name, args, options)
        ignore = _mean_decided_by_rounding(name, args, options, torch_ref.shape)
        errors.append(_placement_error(ref, torch_ref, ignore, floor=SCALE_FLOOR[name])
                      / 1e-9)
        ref = _torch_reference(name, args, options, gpu=True) if gpu else torch_ref
    if not gpu:
        return name, draw, max(errors)
    # An offset input (values 5-6 over a spread of 0.29) keeps its spread in fewer bits:
    # TF32's 10 bits round it about 19 times as coarsely relative to the spread, and the
    # normalizations subtract the mean that hides it.
    if precision == "tf32":
        tol = 2e-2 if offset else 5e-3
    else:
        tol = 3e-4 if offset else 1e-4
    import cupy

    gpu_args = [_to_gpu(a) for a in args]
    gpu_options = {k: _to_gpu(v) for k, v in options.items()}
    if nonfinite and name == "C":
        ignore = _float32_underflow(name, args, options)
    with plan_options(engine=engine):
        for i in range(3):  # then into NaN-poisoned outs: an element left unwritten fails
            poisoned = {} if i == 0 else dict(out=cupy.full(ref.shape, cupy.nan,
                                                            dtype=cupy.float32))
            out = fn(*gpu_args, **gpu_options, precision=precision, **poisoned)
            errors.append((_placement_error(out.get(), ref, ignore, floor=SCALE_FLOOR[name])
                           if nonfinite
                           else rel_err(out, ref)) / tol)
    return name, draw, max(errors)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1, help="random seed (1)")
    parser.add_argument("--seconds", type=float, default=60.0, help="time to run (60)")
    parser.add_argument("--cases", nargs="*", choices=sorted(CASES), default=sorted(CASES))
    parser.add_argument("--nonfinite", action="store_true",
                        help="plant NaN / inf values and compare with PyTorch float64")
    parser.add_argument("--cpu", action="store_true",
                        help="the NumPy path only (with --nonfinite)")
    args = parser.parse_args(argv)
    if args.cpu and not args.nonfinite:
        parser.error("--cpu compares with PyTorch only with --nonfinite")
    if not args.cpu:
        from cufused._arrays import gpu_available

        if not gpu_available():
            parser.error("no CUDA GPU: the GPU path needs one (--cpu --nonfinite runs the "
                         "NumPy path)")
    rng = np.random.default_rng(args.seed)
    ran = {name: 0 for name in args.cases}
    failed = 0
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        result = run_case(rng, str(rng.choice(args.cases)), nonfinite=args.nonfinite,
                          gpu=not args.cpu)
        if result is None:
            continue
        name, draw, ratio = result
        ran[name] += 1
        if not ratio < 1.0:  # NaN fails too
            failed += 1
            print(f"FAIL {name}: error {ratio:.2f}x the tolerance, {draw}", flush=True)
    print(f"cases run: {ran}; failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
