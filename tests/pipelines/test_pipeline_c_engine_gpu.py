"""Pipeline C on cufused's implicit GEMM (``conv_transpose3d_s2k3``): the softmax sums in the
convolution's epilogue, the convolution computed again for the result; in 3xTF32 on the wgmma
build, where C_in % 4 == 0 and C_out is even, the class groups' channels-last result read by
the softmax's passes. Against the float64
reference on odd shapes in both tensor-core precisions, repeated calls (a replayed graph), the
problems it does not take (cuDNN instead) and the autotuner's choice."""

from __future__ import annotations

import numpy as np
import pytest

import cufused
import cufused.pipelines._common as pipelines_common
import cufused.pipelines.pipeline_c as c_module
from cufused._settings import plan_options
from cufused._kernels._common import clamp_middle

from conftest import GPU, count_calls, kernels_built, mixed, poisoned, rel_err, to_gpu

pytestmark = pytest.mark.gpu

if GPU:
    import cupy as cp

# Issue 26's accuracy for pipeline C (relative, as design.md measures C).
TOL = {"tf32": 5e-3, "3xtf32": 1e-5}

pipeline_c = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply

CASES = [
    # input before the pool (N, C_in, D, H, W), C_out, output_padding, pool window
    ((2, 5, 14, 18, 38), 37, (1, 0, 1), 2),  # C_in % 4 != 0: the halo copied a float at a time
    ((1, 1, 2, 2, 2), 1, 1, 2),  # one sample, one channel, one pooled position
    ((3, 32, 10, 12, 34), 64, 1, 2),  # the canonical channels; tiles cut at every edge
    ((2, 8, 12, 9, 33), 33, 0, 3),  # pool 3 (floor), odd W_out: single stores
    ((2, 16, 8, 8, 64), 8, 1, 2),  # whole tiles along W, paired stores
]


def _arrays(rng, shape, cout):
    x = rng.random(shape)
    w = rng.standard_normal((shape[1], cout, 3, 3, 3))
    return x, w, mixed(rng, cout).reshape(1, cout, 1, 1, 1), rng.standard_normal(cout)


def _opts(op, pool, clamp=(-0.5, 1.0)):
    return dict(stride=2, padding=1, output_padding=op, pool_kernel=pool, clamp_min=clamp[0],
                clamp_max=clamp[1])


@pytest.mark.parametrize("precision", ["tf32", "3xtf32"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3]}")
def test_matches_reference(rng, monkeypatch, precision, case):
    shape, cout, op, pool = case
    x, w, scale, cb = _arrays(rng, shape, cout)
    ref = pipeline_c(x, w, scale, **_opts(op, pool), conv_bias=cb)
    from cufused._kernels.conv_gemm import _FILE, arch_target

    calls = count_calls(monkeypatch, c_module, "conv_transpose3d_softmax")
    groups = count_calls(monkeypatch, c_module, "conv_transpose3d_groups_softmax_sums")
    out = poisoned(ref.shape)
    args = to_gpu(x, w, scale, cb)
    with plan_options(engine="igemm"):
        pipeline_c(*args[:3], **_opts(op, pool), conv_bias=args[3], precision=precision,
                   out=out)
        first = out.get()
        out[...] = cp.nan
        pipeline_c(*args[:3], **_opts(op, pool), conv_bias=args[3], precision=precision,
                   out=out)  # a replayed graph of the whole call
    on_groups = (precision == "3xtf32" and shape[1] % 4 == 0 and cout % 2 == 0
                 and arch_target(_FILE) == "sm_90a")
    assert bool(groups) == on_groups and bool(calls) != on_groups, (calls, groups)
    assert rel_err(first, ref) < TOL[precision]
    np.testing.assert_array_equal(out.get(), first)


@pytest.mark.parametrize("c_in", [7, 8])
def test_both_builds_agree(rng, monkeypatch, c_in):
    # On compute capability 9.0 "tf32" runs on the warpgroup MMA (sm_90a's build), its halo
    # by the tensor memory accelerator where C_in % 4 == 0; the portable build's mma.sync
    # takes the same TF32 operands and each output's taps in the same order, its halo by
    # cp.async. So the result from given factors agrees bit for bit; pass 1's sums over a
    # run add the same values in another order (the builds give a lane other rows). The
    # direct calls also run on 4 blocks a channel tile, each taking several tiles of both
    # samples: the result is the same bit for bit on any schedule of the tiles.
    import cufused._kernels.conv_gemm as conv
    from cufused._cuda import _CubinKernel, get_kernel
    from cufused._layout import empty_in_layout

    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the warpgroup-MMA build needs compute capability 9.0")
    native = get_kernel("conv_gemm.cu", "conv_transpose3d_s2k3<1, CT3_SOFTMAX, false>")
    assert isinstance(native, _CubinKernel)
    maps, make_map = [], conv.float32_tensor_map
    monkeypatch.setattr(conv, "float32_tensor_map",
                        lambda *args: maps.append(make_map(*args)) or maps[-1])
    x, w, scale, cb = _arrays(rng, (2, c_in, 12, 14, 34), 40)
    ref = pipeline_c(x, w, scale, **_opts(1, 2), conv_bias=cb)
    calls = count_calls(monkeypatch, c_module, "conv_transpose3d_softmax")
    args = to_gpu(x, w, scale, cb)
    # The kernels' own operands: a pooled channels-last input, factors of either sign.
    pooled = empty_in_layout((2, c_in, 6, 7, 17), "nhwc")
    pooled[...] = cp.asarray(rng.standard_normal(pooled.shape), dtype=cp.float32)
    factor = cp.asarray(mixed(rng, 2 * 40), dtype=cp.float32)
    clamp, out_shape = (-0.5, 1.0), (2, 40, 12, 14, 34)
    got, sums, direct = {}, {}, {}
    for build in ("native", "portable"):
        out = poisoned(ref.shape)
        with kernels_built(build), plan_options(engine="igemm"):
            pipeline_c(*args[:3], **_opts(1, 2), conv_bias=args[3], precision="tf32", out=out)
            for sms in (None, 8):
                with pytest.MonkeyPatch.context() as patch:
                    if sms:
                        patch.setattr(conv, "sm_count", lambda: sms)
                    partial, _ = conv.conv_transpose3d_softmax_sums(
                        cp, pooled, args[1], args[3], out_shape=out_shape, clamp=clamp,
                        passes=1)
                    y = poisoned(out_shape)
                    conv.conv_transpose3d_softmax(pooled, args[1], args[3], y, factor,
                                                  clamp=clamp, passes=1)
                sums[build, sms], direct[build, sms] = partial.get(), y.get()
        got[build] = out.get()
        assert rel_err(got[build], ref) < TOL["tf32"], build
    assert len(calls) == 2
    # The driver's maps where C_in % 4 == 0 (the portable build ignores them), else none.
    assert (len(maps) >= 4) == (c_in % 4 == 0) and all(maps)
    first = direct["native", None]
    assert not np.isnan(first).any()
    for key, y in direct.items():
        np.testing.assert_array_equal(y.view(np.uint32), first.view(np.uint32), err_msg=key)
    for sms in (None, 8):  # the same runs in both builds: each run's sum, in another order
        np.testing.assert_array_equal(sums["native", sms][..., 0],
                                      np.float32(clamp_middle(clamp)))
        np.testing.assert_allclose(sums["native", sms][..., 1], sums["portable", sms][..., 1],
                                   rtol=1e-6)
    np.testing.assert_allclose(got["native"], got["portable"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("precision", ["tf32", "3xtf32"])
def test_non_finite_values_as_the_reference(rng, precision):
    # A NaN and an infinity in x, an infinite weight: the float64 reference's NaN and
    # infinity placement (3xTF32: the class groups' sums in the epilogue see the NaN rows;
    # the infinite weight's channel recomputed by the definition), its values elsewhere.
    x, w, scale, cb = _arrays(rng, (2, 16, 8, 10, 34), 8)
    x[0, 3, 2, 4, 5], x[1, 7, 1, 1, 1] = np.nan, np.inf
    w[2, 5, 1, 1, 1] = np.inf
    with np.errstate(all="ignore"):
        ref = pipeline_c(x, w, scale, **_opts(1, 2), conv_bias=cb)
    out = poisoned(ref.shape)
    args = to_gpu(x, w, scale, cb)
    with plan_options(engine="igemm"):
        pipeline_c(*args[:3], **_opts(1, 2), conv_bias=args[3], precision=precision, out=out)
    got = out.get()
    for test in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(test(got), test(ref))
    assert np.isnan(ref).any()
    finite = np.isfinite(ref)
    assert rel_err(got[finite], ref[finite]) < TOL[precision]


@pytest.mark.parametrize("precision", ["tf32", "3xtf32"])
def test_without_bias_or_scale(rng, precision):
    x, w, _, _ = _arrays(rng, (2, 6, 8, 10, 20), 12)
    ref = pipeline_c(x, w, None, **_opts(1, 2))
    out = poisoned(ref.shape)
    with plan_options(engine="igemm"):
        pipeline_c(*to_gpu(x, w), None, **_opts(1, 2), precision=precision, out=out)
    assert rel_err(out.get(), ref) < TOL[precision]


@pytest.mark.parametrize("opts", [
    dict(stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=-100.0,
         clamp_max=100.0),  # a clamp wider than 60: exp(v - ref) may overflow a row's sum
    dict(stride=1, padding=1, output_padding=0, pool_kernel=2, clamp_min=0.0, clamp_max=1.0),
])
def test_problems_it_does_not_take_go_to_cudnn(rng, monkeypatch, opts):
    x, w, scale, cb = _arrays(rng, (2, 4, 8, 8, 8), 6)
    ref = pipeline_c(x, w, scale, **opts, conv_bias=cb)
    calls = count_calls(monkeypatch, c_module, "conv_transpose3d_softmax")
    out = poisoned(ref.shape)
    args = to_gpu(x, w, scale, cb)
    with plan_options(engine="igemm"):
        pipeline_c(*args[:3], **opts, conv_bias=args[3], precision="tf32", out=out)
    assert not calls
    # TF32 leaves y about 1e-3 * |y| off, and exp(y - max) carries that error times up to
    # the clamp's width: a clamp of width 200 gets ten times the usual bound.
    wide = opts["clamp_max"] - opts["clamp_min"] > 60
    assert rel_err(out.get(), ref) < (10 if wide else 1) * TOL["tf32"]


def test_the_autotuner_picks_a_path(rng):
    # Either path gives the result; the choice is measured once per problem.
    x, w, scale, cb = _arrays(rng, (2, 8, 8, 12, 16), 16)
    ref = pipeline_c(x, w, scale, **_opts(1, 2), conv_bias=cb)
    out = poisoned(ref.shape)
    with plan_options(engine="auto", autotune=True):
        pipeline_c(*to_gpu(x, w, scale, cb)[:3], **_opts(1, 2), conv_bias=to_gpu(cb)[0],
                   precision="tf32", out=out)
    assert rel_err(out.get(), ref) < TOL["tf32"]


def test_the_autotuner_without_memory_for_its_operands(rng, monkeypatch):
    # Where the measurement's operands do not fit beside the caller's, the call runs on
    # cuDNN, and the problem is not measured again.
    def out_of_memory(*args, **kwargs):
        raise cp.cuda.memory.OutOfMemoryError(1 << 40, 0)

    monkeypatch.setattr(pipelines_common, "fastest", out_of_memory)
    measured = count_calls(monkeypatch, pipelines_common, "fastest")
    calls = count_calls(monkeypatch, c_module, "conv_transpose3d_softmax")
    x, w, scale, cb = _arrays(rng, (2, 8, 8, 12, 14), 10)
    ref = pipeline_c(x, w, scale, **_opts(1, 2), conv_bias=cb)
    args = to_gpu(x, w, scale, cb)
    with plan_options(engine="auto", autotune=True):
        for _ in range(2):
            out = poisoned(ref.shape)
            pipeline_c(*args[:3], **_opts(1, 2), conv_bias=args[3], precision="tf32", out=out)
            assert rel_err(out.get(), ref) < TOL["tf32"]
    assert measured == ["fastest"] and not calls
