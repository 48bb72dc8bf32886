"""NaN and inf land where PyTorch puts them: one NaN, +inf or -inf planted in each input and
parameter of every pipeline and normalization block, on both paths. The NumPy path is compared
with PyTorch CPU in float64 and the GPU path with PyTorch CUDA in float32 (TF32 off), except
for an infinite weight of C's transposed convolution: there PyTorch CUDA's float32 NaNs depend
on its convolution algorithm (inf * 0 on the zeros a stride inserts, or not), while PyTorch in
float64, on the CPU and on CUDA alike, has the definition's products only, as cufused does."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

import cufused

from conftest import GPU, count_calls

torch = pytest.importorskip("torch")
F = torch.nn.functional

VALUES = [np.nan, np.inf, -np.inf]


def _t(v, device, dtype):
    return None if v is None else torch.as_tensor(v, dtype=dtype, device=device)


def torch_a(v, device, dtype, pool=2):
    x, w, cb, gw, gb, s = (_t(a, device, dtype) for a in v)
    y = F.group_norm(F.conv2d(x, w, cb), 4, gw, gb, eps=1e-5) * s.view(1, -1, 1, 1)
    return torch.clamp(F.max_pool2d(y, pool), 0.0, 1.0)


def torch_b(v, device, dtype):
    x, w, bw, bb, gw, gb, cb = (_t(a, device, dtype) for a in v)
    y = F.conv_transpose2d(x, w, cb, padding=1)
    y = torch.tanh(F.batch_norm(y, None, None, bw, bb, training=True, eps=1e-5))
    return F.group_norm(F.max_pool2d(y, 2, 2), 4, gw, gb, eps=1e-5)


def torch_c(v, device, dtype, clamp=(0.0, 1.0)):
    x, w, s, cb = (_t(a, device, dtype) for a in v)
    y = F.conv_transpose3d(F.avg_pool3d(x, 2), w, cb, stride=2, padding=1, output_padding=1)
    y = torch.clamp(y, *clamp)
    n, c = y.shape[:2]
    return torch.softmax(y.reshape(n, c, -1), dim=2).reshape(y.shape) * s.view(1, -1, 1, 1, 1)


def torch_gn(v, device, dtype):
    x, w, b = (_t(a, device, dtype) for a in v)
    return F.group_norm(x, 2, w, b)


def torch_bn(v, device, dtype):
    x, w, b = (_t(a, device, dtype) for a in v)
    return torch.tanh(F.batch_norm(x, None, None, w, b, training=True))


def ours_a(v, pool=2):
    x, w, cb, gw, gb, s = v
    return cufused.conv2d_groupnorm_scale_maxpool_clamp(
        x, w, cb, gw, gb, s, num_groups=4, pool_kernel=pool, clamp_min=0.0, clamp_max=1.0)


def ours_b(v):
    x, w, bw, bb, gw, gb, cb = v
    return cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        x, w, bw, bb, gw, gb, num_groups=4, padding=1, conv_bias=cb)


def ours_c(v, clamp=(0.0, 1.0)):
    x, w, s, cb = v
    return cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
        x, w, s, stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=clamp[0],
        clamp_max=clamp[1], conv_bias=cb)


def ours_gn(v):
    return cufused.group_norm(v[0], 2, v[1], v[2])


def ours_bn(v):
    return cufused.batch_norm(v[0], v[1], v[2], activation="tanh")


def torch_bn_no_bias(v, device, dtype):
    x, w = (_t(a, device, dtype) for a in v)
    return torch.tanh(F.batch_norm(x, None, None, w, None, training=True))


def ours_bn_no_bias(v):
    return cufused.batch_norm(v[0], v[1], activation="tanh")


def make(case, rng):
    """(parameter names, float64 values) with mixed signs."""
    n = rng.standard_normal
    if case in ("A", "A, 4 x 4 windows"):
        return (["x", "weight", "conv_bias", "gn_weight", "gn_bias", "scale"],
                [rng.random((2, 3, 10, 10)), n((8, 3, 3, 3)) * 0.3, n(8) * 0.1, n(8),
                 n(8) * 0.1, n(8)])
    if case == "A, 1 x 1 convolution output":  # GroupNorm of one value per channel
        return (["x", "weight", "conv_bias", "gn_weight", "gn_bias", "scale"],
                [rng.random((3, 3, 3, 3)), n((8, 3, 3, 3)) * 0.3, n(8) * 0.1, n(8),
                 n(8) * 0.1, n(8)])
    if case == "B":
        return (["x", "weight", "bn_weight", "bn_bias", "gn_weight", "gn_bias", "conv_bias"],
                [rng.random((3, 4, 5, 5)), n((4, 8, 3, 3)) * 0.3, n(8), n(8) * 0.1, n(8),
                 n(8) * 0.1, n(8) * 0.1])
    if case == "B, 1 x 1 pooled":  # GroupNorm of one value per channel
        return (["x", "weight", "bn_weight", "bn_bias", "gn_weight", "gn_bias", "conv_bias"],
                [rng.random((3, 4, 2, 2)), n((4, 8, 3, 3)) * 0.3, n(8), n(8) * 0.1, n(8),
                 n(8) * 0.1, n(8) * 0.1])
    if case == "C":
        return (["x", "weight", "scale", "conv_bias"],
                [rng.random((2, 3, 4, 6, 6)), n((3, 4, 3, 3, 3)) * 0.3, n(4), n(4) * 0.1])
    if case == "group_norm rows":  # rows that stay in shared memory
        return ["x", "weight", "bias"], [n((2, 4, 3, 3)), n(4), n(4)]
    if case == "group_norm split":  # rows that take the split statistics and affine pass
        return ["x", "weight", "bias"], [n((2, 4, 80, 80)), n(4), n(4)]
    if case == "group_norm (N, C)":  # one value per channel: PyTorch CUDA's centered form
        return ["x", "weight", "bias"], [n((3, 8)), n(8), n(8)]
    if case == "group_norm (N, C, 1)":
        return ["x", "weight", "bias"], [n((3, 8, 1)), n(8), n(8)]
    if case == "group_norm (N, C, 1, 1)":
        return ["x", "weight", "bias"], [n((3, 8, 1, 1)), n(8), n(8)]
    if case == "group_norm (N, C) split":  # 2 groups of 12289 values: past the row cache
        return ["x", "weight", "bias"], [n((2, 24578)), n(24578), n(24578)]
    if case == "batch_norm tanh, no bias":  # PyTorch CUDA's native kernel: centered
        return ["x", "weight"], [n((3, 4, 5, 5)), n(4)]
    if case == "batch_norm tanh (N, C)":  # the same
        return ["x", "weight", "bias"], [n((6, 4)), n(4), n(4)]
    return ["x", "weight", "bias"], [n((3, 4, 5, 5)), n(4), n(4)]


CASES = {"A": (torch_a, ours_a),
         "A, 1 x 1 convolution output": (partial(torch_a, pool=1), partial(ours_a, pool=1)),
         # 3xTF32's epilogue with the weights held in registers on the wgmma build.
         "A, 4 x 4 windows": (partial(torch_a, pool=4), partial(ours_a, pool=4)),
         "B": (torch_b, ours_b), "B, 1 x 1 pooled": (torch_b, ours_b),
         "C": (torch_c, ours_c),
         "group_norm rows": (torch_gn, ours_gn), "group_norm split": (torch_gn, ours_gn),
         "group_norm (N, C)": (torch_gn, ours_gn), "group_norm (N, C, 1)": (torch_gn, ours_gn),
         "group_norm (N, C, 1, 1)": (torch_gn, ours_gn),
         "group_norm (N, C) split": (torch_gn, ours_gn),
         "batch_norm tanh": (torch_bn, ours_bn),
         "batch_norm tanh, no bias": (torch_bn_no_bias, ours_bn_no_bias),
         "batch_norm tanh (N, C)": (torch_bn, ours_bn)}
PLANTS = [(case, i, value) for case in CASES
          for i in range(len(make(case, np.random.default_rng())[0])) for value in VALUES]


def _ids(p):
    case, i, value = p
    return f"{case}-{make(case, np.random.default_rng())[0][i]}-{value}"


def _planted(case, i, value, rng):
    names, values = make(case, rng)
    target = values[i]
    target[tuple(int(rng.integers(s)) for s in target.shape)] = value
    return values


def assert_same_placement(got, want, rtol=1e-4):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    for name, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        diff = test(got) != test(want)
        assert not diff.any(), f"{int(diff.sum())} elements differ in {name} placement"
    finite = np.isfinite(want)
    scale = max(float(np.abs(want[finite]).max()), 1e-30) if finite.any() else 1.0
    assert np.abs(got[finite] - want[finite]).max(initial=0.0) <= rtol * scale


@pytest.mark.parametrize("plant", PLANTS, ids=_ids)
def test_numpy_path_matches_torch_cpu(rng, plant):
    case, i, value = plant
    values = _planted(case, i, value, rng)
    torch_fn, ours = CASES[case]
    want = torch_fn(values, "cpu", torch.float64).numpy()
    assert_same_placement(ours([v.astype(np.float32) for v in values]), want)


def _algorithm_dependent(plant) -> bool:
    """An infinite weight of C's transposed convolution (see the module docstring)."""
    case, i, value = plant
    return case == "C" and i == 1 and np.isinf(value)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device with CuPy")
@pytest.mark.parametrize("plant", PLANTS, ids=_ids)
def test_gpu_path_matches_torch_cuda(rng, plant, monkeypatch):
    _check_gpu_plant(rng, plant, "ieee", 1e-4, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device with CuPy")
@pytest.mark.parametrize("plant", [p for p in PLANTS if _algorithm_dependent(p)], ids=_ids)
@pytest.mark.parametrize("precision, method", [("tf32", "fused"), ("ieee", "unfused"),
                                               ("tf32", "unfused")])
def test_gpu_c_infinite_weight_on_every_path(rng, plant, precision, method, monkeypatch):
    # The rows of the infinite weight's channel follow the definition in either precision and
    # method; the other channels carry TF32's rounding.
    def ours(v):
        x, w, s, cb = v
        return cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
            x, w, s, stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=0.0,
            clamp_max=1.0, conv_bias=cb, method=method)

    _check_gpu_plant(rng, plant, precision, 1e-2 if precision == "tf32" else 1e-4,
                     monkeypatch, ours)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device with CuPy")
@pytest.mark.parametrize("plant", [p for p in PLANTS if p[0] in ("A", "A, 4 x 4 windows")],
                         ids=_ids)
def test_gpu_a_on_the_convolution_epilogue(rng, plant, monkeypatch):
    # Pipeline A with its pass in the convolution's epilogue (3xTF32 on the implicit GEMM:
    # the convolution output is never stored, and the channels with a non-finite parameter
    # are recomputed from x and w): NaN and inf where PyTorch puts them.
    from cufused._settings import plan_options

    with plan_options(engine="igemm"):
        _check_gpu_plant(rng, plant, "3xtf32", 1e-4, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device with CuPy")
@pytest.mark.parametrize("plant", [p for p in PLANTS if p[0] in ("A", "A, 4 x 4 windows")],
                         ids=_ids)
def test_gpu_a_on_the_convolution_epilogue_with_strided_operands(rng, plant, monkeypatch):
    # The same with x channels-last and the weight a transposed view: the channels with a
    # non-finite parameter are recomputed from the contiguous copies that the convolution
    # reads, not from the caller's strided arrays.
    import cupy as cp

    from cufused._settings import plan_options
    from cufused.pipelines import pipeline_a

    def ours(v):
        x = cp.ascontiguousarray(v[0].transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
        w = cp.ascontiguousarray(v[1].transpose(1, 0, 2, 3)).transpose(1, 0, 2, 3)
        assert not (x.flags.c_contiguous or w.flags.c_contiguous)
        return CASES[plant[0]][1]([x, w, *v[2:]])  # the case's windows

    calls = count_calls(monkeypatch, pipeline_a, "pool_affine_nonfinite_conv")
    with plan_options(engine="igemm"):
        _check_gpu_plant(rng, plant, "3xtf32", 1e-4, monkeypatch, ours)
    assert calls  # the path that recomputes from x and w ran


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device with CuPy")
@pytest.mark.parametrize("plant", [p for p in PLANTS if p[0] == "C"], ids=_ids)
@pytest.mark.parametrize("precision, rtol", [("3xtf32", 1e-4), ("tf32", 1e-2)])
def test_gpu_c_on_the_convolution_epilogue(rng, plant, precision, rtol, monkeypatch):
    # Pipeline C on the implicit GEMM (the softmax sums in the convolution's epilogue, the
    # convolution computed again for the result; rows of a channel with a non-finite weight
    # recomputed by the definition): NaN and inf where PyTorch puts them.
    from cufused._settings import plan_options
    from cufused.pipelines import pipeline_c

    calls = count_calls(monkeypatch, pipeline_c, "conv_transpose3d_softmax")
    with plan_options(engine="igemm"):
        _check_gpu_plant(rng, plant, precision, rtol, monkeypatch)
    assert calls  # the path ran


def _check_gpu_plant(rng, plant, precision, rtol, monkeypatch, ours=None):
    import cupy as cp

    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # float32 like ours
    case, i, value = plant
    values = _planted(case, i, value, rng)
    torch_fn = CASES[case][0]
    ours = ours or CASES[case][1]
    dtype = torch.float64 if _algorithm_dependent(plant) else torch.float32
    want = torch_fn(values, "cuda", dtype).cpu().numpy()
    with cufused.default_precision(precision):
        got = ours([cp.asarray(v, dtype=cp.float32) for v in values]).get()
    assert_same_placement(got, want, rtol)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device with CuPy")
@pytest.mark.parametrize("value", [np.inf, -np.inf])
def test_gpu_c_infinite_weight_with_a_wide_clamp(rng, value):
    # A row recomputed for an infinite weight is shifted by its own maximum: with a wide clamp
    # the clamp's upper bound would overflow the softmax's factor.
    import cupy as cp

    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    values = _planted("C", 1, value, rng)
    clamp = (-1000.0, 1000.0)
    want = torch_c(values, "cuda", torch.float64, clamp).cpu().numpy()
    got = ours_c([cp.asarray(v, dtype=cp.float32) for v in values], clamp).get()
    assert_same_placement(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device with CuPy")
@pytest.mark.parametrize("method", ["fused", "unfused"])
@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_gpu_b_nonfinite_bn_weight_without_a_bias_on_both_routes(rng, method, value):
    # Pipeline B keeps BatchNorm's a * y + b without a bias too (semantics.rst), on either
    # route: a channel with a non-finite weight is NaN, and so is its GroupNorm group.
    import cupy as cp

    from conftest import pipeline_b_args

    (x, w, bw, _, gw, gb), opts = pipeline_b_args(rng)
    bw = bw.copy()
    bw[1] = value
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(x, w, bw, None, gw, gb,
                                                                     **opts)
    assert np.isnan(ref[:, :4]).all() and np.isfinite(ref[:, 4:]).all()
    got = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *(cp.asarray(a, dtype=cp.float32) for a in (x, w, bw)), None,
        *(cp.asarray(a, dtype=cp.float32) for a in (gw, gb)), **opts, method=method)
    assert_same_placement(got.get(), ref)
