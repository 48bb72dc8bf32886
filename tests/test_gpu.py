"""GPU path against the float64 NumPy reference (and PyTorch CUDA where importable)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import cufused

from conftest import GPU, assert_close, mixed, rel_err

pytestmark = pytest.mark.gpu

if GPU:
    import cupy as cp

TOL = {"ieee": 1e-5, "tf32": 5e-3}


@pytest.fixture(autouse=True)
def quick_plans():
    """Heuristic cuDNN plans (no autotuning) keep the suite fast; tests opt back in."""
    from cufused._cudnn import plan_options

    with plan_options(autotune=False):
        yield


# Convolution strategies pinned in turn (labels of cufused._cudnn.Strategy), so that every
# cuDNN graph form and every layout the fused kernels read runs: NCHW, channels-last, an NCHW
# input with a channels-last output, the bias inside the graph, and the sub-pixel split
# (flipped-kernel forward convolution for stride 1, class-major blocks for stride 2).
CONV_PINS = ["nchw", "nhwc", "nchw>nhwc", "nchw+bias", "subpixel nchw", "subpixel nhwc"]
PIPELINE_PINS = ["nchw", "nhwc", "nchw>nhwc", "subpixel nchw"]


def _pinned(pin):
    from cufused._cudnn import plan_options

    return plan_options(autotune=False, pins=(pin,))


@pytest.fixture(params=CONV_PINS)
def conv_pin(request):
    with _pinned(request.param):
        yield request.param


@pytest.fixture(params=PIPELINE_PINS)
def layout(request):
    with _pinned(request.param):
        yield request.param


def to_gpu(*arrays):
    return [None if a is None else cp.asarray(a, dtype=cp.float32) for a in arrays]


def poisoned(shape):
    return cp.full(shape, cp.nan, dtype=cp.float32)


# ---------------------------------------------------------------------------------- convolutions

CONV_CASES = [
    # nd, transposed, x shape, w shape, options
    (2, False, (3, 5, 17, 13), (7, 5, 3, 3), dict(stride=1, padding=0)),
    (2, False, (2, 6, 19, 23), (9, 2, 3, 5),
     dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=3)),
    (2, False, (1, 3, 11, 11), (4, 3, 1, 1), dict(stride=3)),
    (3, False, (2, 4, 7, 9, 8), (6, 2, 3, 3, 3), dict(stride=2, padding=1, groups=2)),
    (2, True, (3, 6, 7, 11), (6, 5, 5, 5), dict(stride=1, padding=1)),
    (2, True, (2, 4, 9, 7), (4, 3, 3, 4),
     dict(stride=(2, 3), padding=(1, 0), output_padding=(1, 2), groups=2)),
    (2, True, (1, 3, 5, 5), (3, 2, 3, 3), dict(stride=2, dilation=2, output_padding=1)),
    (3, True, (2, 5, 4, 5, 3), (5, 7, 3, 3, 3), dict(stride=2, padding=1, output_padding=1)),
    (2, True, (2, 6, 8, 12), (6, 4, 4, 4), dict(stride=2, padding=1, groups=2)),
    (2, True, (2, 4, 3, 8), (4, 3, 2, 2), dict(stride=2, padding=(1, 0))),  # sub-pixel crops
]


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{c[0]}d{'T' if c[1] else ''}{c[2]}")
def test_conv_matches_reference(rng, case, precision, conv_pin):
    nd, transposed, xs, ws, opts = case
    x = rng.standard_normal(xs)
    w = rng.standard_normal(ws)
    b = rng.standard_normal(ws[1] * opts.get("groups", 1) if transposed else ws[0])
    fn = {(2, False): cufused.conv2d, (3, False): cufused.conv3d,
          (2, True): cufused.conv_transpose2d, (3, True): cufused.conv_transpose3d}[nd, transposed]
    ref = fn(x, w, b, **opts)
    xg, wg, bg = to_gpu(x, w, b)
    out = poisoned(ref.shape)
    got = fn(xg, wg, bg, precision=precision, out=out, **opts)
    assert got is out
    assert_close(got.get(), ref, TOL[precision])


@pytest.mark.parametrize("case", [CONV_CASES[0], CONV_CASES[5], CONV_CASES[7]],
                         ids=["2d", "2dT", "3dT"])
def test_conv_plan_replays_graph(rng, case, conv_pin):
    # From the second call with the same operands a plan replays a CUDA graph of its weight
    # preparation and cuDNN calls; new values behind the same pointers (the weight included)
    # must reach it, and it must match a direct run.
    from cufused import _cudnn
    from cufused._layout import empty_in_layout

    nd, transposed, xs, ws, opts = case
    fn = {(2, False): cufused.conv2d, (3, False): cufused.conv3d,
          (2, True): cufused.conv_transpose2d, (3, True): cufused.conv_transpose3d}[nd, transposed]
    xg, wg = to_gpu(rng.standard_normal(xs), rng.standard_normal(ws))
    fn(xg, wg, **opts)
    plan = [p for k, p in _cudnn._plans.items()
            if k[1].x_shape == xs and k[1].precision == "ieee" and k[6] == (conv_pin,)][-1]
    x = empty_in_layout(xs, plan.x_layout)
    x[...] = xg
    y, direct = plan.empty_output(), plan.empty_output()
    for _ in range(3):
        plan.run(x, wg, y)
    assert len(plan._replays) == 1
    x[...] = cp.asarray(rng.standard_normal(xs), dtype=cp.float32)
    wg[...] = cp.asarray(rng.standard_normal(ws), dtype=cp.float32)
    y.fill(cp.nan)
    plan.run(x, wg, y)  # a replay
    with _cudnn.plan_options(replay=False):
        plan.run(x, wg, direct)
    assert len(plan._replays) == 1 and not cp.isnan(y).any()
    assert_close(y.get(), direct.get(), 1e-6)
    # Public calls replay the convolution together with its conversion to NCHW.
    out = cp.empty(plan.problem.y_shape, dtype=cp.float32)
    for _ in range(3):
        fn(xg, wg, out=out, **opts)
    x_new, w_new = rng.standard_normal(xs), rng.standard_normal(ws)
    xg[...], wg[...] = to_gpu(x_new, w_new)
    out.fill(cp.nan)
    fn(xg, wg, out=out, **opts)
    assert len(plan._replays) >= 2
    assert_close(out.get(), fn(x_new, w_new, **opts), TOL["ieee"])
    # With a bias (another plan): new bias values reach the replayed graph too.
    cout = ws[1] * opts.get("groups", 1) if transposed else ws[0]
    bg = cp.asarray(rng.standard_normal(cout), dtype=cp.float32)
    for _ in range(3):
        fn(xg, wg, bg, out=out, **opts)
    b_new = rng.standard_normal(cout)
    bg[...] = cp.asarray(b_new, dtype=cp.float32)
    out.fill(cp.nan)
    fn(xg, wg, bg, out=out, **opts)
    assert_close(out.get(), fn(x_new, w_new, b_new, **opts), TOL["ieee"])


def test_replay_decision_without_memory_for_a_flush(monkeypatch):
    # With no room for the L2 flush buffer the autotuner times unflushed instead of failing.
    from cufused import _cudnn

    def out_of_memory(*args, **kwargs):
        raise cp.cuda.memory.OutOfMemoryError(1 << 40, 0)

    monkeypatch.setattr(cp, "empty", out_of_memory)
    assert _cudnn._l2_flush_buffer() is None


def test_graph_buffers_leave_the_default_pool_alone(rng):
    # What a captured graph keeps (prepared weight, workspace, channels-last output) comes from
    # a pool of its own: taken from CuPy's default pool, it would move later calls'
    # temporaries to new addresses, which are new graph keys and new captures.
    from cufused import _cudnn

    xs, ws = (2, 6, 9, 7), (6, 4, 3, 3)
    xg, wg = to_gpu(rng.standard_normal(xs), rng.standard_normal(ws))
    out = cp.empty((2, 4, 11, 9), dtype=cp.float32)
    pool = cp.get_default_memory_pool()
    with _pinned("nhwc"):
        cufused.conv_transpose2d(xg, wg, out=out)
        used = pool.used_bytes()
        for _ in range(3):
            cufused.conv_transpose2d(xg, wg, out=out)
        assert pool.used_bytes() == used
    plan = [p for k, p in _cudnn._plans.items() if k[1].x_shape == xs and k[6] == ("nhwc",)][-1]
    assert plan.layout == "nhwc" and len(plan._replays) == 1
    graph_pool = _cudnn._graph_buffer_pool()
    assert graph_pool.used_bytes() > 0
    # Forgetting the plans frees what their graphs kept, back to the device.
    plan = None
    cufused.clear_plan_cache()
    assert graph_pool.used_bytes() == 0 and graph_pool.total_bytes() == 0


@pytest.mark.parametrize("direct_wins", [False, True])
def test_autotuned_plan_replay_decision(rng, monkeypatch, direct_wins):
    # The autotuner times its chosen plan replayed and issued directly and keeps direct calls
    # only where they win by more than _REPLAY_MARGIN. Which way a tiny convolution's timings
    # fall is a measurement of the host, so the margin forces each outcome here (the rule
    # itself is unit-tested with fake timings in test_conv_keys). Either way none of the
    # graphs of the autotuner's operands is kept; a replaying plan then captures one graph
    # for the caller's operands, a direct one none.
    from cufused import _cudnn
    from cufused._cudnn import _autotune

    monkeypatch.setattr(_autotune, "_REPLAY_MARGIN", -1.0 if direct_wins else 1e9)
    cufused.clear_plan_cache()  # so that the plan is autotuned under this margin
    xs, ws = (2, 3, 9, 13), (5, 3, 3, 3)
    xg, wg = to_gpu(rng.standard_normal(xs), rng.standard_normal(ws))
    with _cudnn.plan_options(autotune=True, replay=True):
        out = cufused.conv2d(xg, wg)
        plan = [p for k, p in _cudnn._plans.items() if k[1].x_shape == xs][-1]
        assert plan.replays is not direct_wins
        if not direct_wins:
            assert plan._replays == {}
        for _ in range(2):
            cufused.conv2d(xg, wg, out=out)
    if direct_wins:
        assert plan._replays is None
    else:
        assert len(plan._replays) == 1
    assert_close(out.get(), cufused.conv2d(xg.get(), wg.get()), TOL["ieee"])


def test_conv_capture_in_cuda_graph(rng, conv_pin):
    # A caller's capture records the cuDNN calls themselves (no graph launch inside it), also
    # after warm calls on that stream have captured the plan's own graph.
    x, w = rng.standard_normal((3, 6, 7, 11)), rng.standard_normal((6, 5, 5, 5))
    ref = cufused.conv_transpose2d(x, w, padding=1)
    xg, wg = to_gpu(x, w)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out = cp.empty(ref.shape, dtype=cp.float32)
        for _ in range(3):
            cufused.conv_transpose2d(xg, wg, padding=1, out=out)
        stream.begin_capture()
        cufused.conv_transpose2d(xg, wg, padding=1, out=out)
        graph = stream.end_capture()
        out.fill(cp.nan)
        graph.launch()
    stream.synchronize()
    assert_close(out.get(), ref, TOL["ieee"])


def test_conv_non_contiguous_input_and_stream(rng):
    x = rng.standard_normal((4, 3, 12, 10))
    w = rng.standard_normal((5, 3, 3, 3))
    ref = cufused.conv2d(x[:, :, ::2], w, padding=1)
    xg = cp.asarray(x, dtype=cp.float32)[:, :, ::2]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        got = cufused.conv2d(xg, cp.asarray(w, dtype=cp.float32), padding=1)
    stream.synchronize()
    assert_close(got.get(), ref, TOL["ieee"])


def test_conv_matches_torch_cuda(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    x = rng.standard_normal((2, 8, 16, 16)).astype(np.float32)
    w = rng.standard_normal((8, 4, 3, 3)).astype(np.float32)
    ref = torch.nn.functional.conv_transpose2d(
        torch.from_numpy(x).cuda().double(), torch.from_numpy(w).cuda().double(), stride=2,
        padding=1, output_padding=1).cpu().numpy()
    got = cufused.conv_transpose2d(cp.asarray(x), cp.asarray(w), stride=2, padding=1,
                                   output_padding=1)
    assert_close(got.get(), ref, TOL["ieee"])


def test_conv_autotune_times_both_layouts(rng):
    from cufused import _cudnn

    x = rng.standard_normal((2, 3, 9, 9))
    w = rng.standard_normal((4, 3, 2, 2))
    with _cudnn.plan_options(autotune=True):
        got = cufused.conv2d(*to_gpu(x, w), stride=2)
    assert_close(got.get(), cufused.conv2d(x, w, stride=2), TOL["ieee"])
    plans = [p for k, p in _cudnn._plans.items() if k[1].x_shape == (2, 3, 9, 9) and k[5]]
    assert len(plans) == 1 and len(plans[0].candidates) >= 3  # NCHW, NHWC, NCHW -> NHWC
    assert min(cost for _, cost in plans[0].candidates.values()) == plans[0].cost


def test_conv_autotune_weighs_subpixel_split(rng):
    from cufused import _cudnn

    x = rng.standard_normal((2, 4, 4, 6, 8))
    w = rng.standard_normal((4, 3, 3, 3, 3))
    opts = dict(stride=2, padding=1, output_padding=1)
    with _cudnn.plan_options(autotune=True):
        got = cufused.conv_transpose3d(*to_gpu(x, w), **opts)
    assert_close(got.get(), cufused.conv_transpose3d(x, w, **opts), TOL["ieee"])
    plans = [p for k, p in _cudnn._plans.items() if k[1].x_shape == (2, 4, 4, 6, 8) and k[5]]
    assert len(plans) == 1 and "subpixel nchw" in plans[0].candidates


# ---------------------------------------------------------------------------- building blocks


# Rows cached and visited by channel (H*W >= 32; (2, 24, 6, 7): more channels per row than
# warps), cached per vector (H*W < 32) and uncached ((2, 6, 67, 131)).
@pytest.mark.parametrize("shape,groups", [((3, 12, 7, 5), 4), ((2, 6, 67, 131), 2),
                                          ((1, 4, 1), 1), ((5, 9, 11), 3),
                                          ((2, 8, 6, 10), 4), ((3, 8, 2, 3), 4),
                                          ((2, 24, 6, 7), 2)])
def test_group_norm(rng, shape, groups):
    # |mean| >> std: the shifted sums must keep the variance accurate. The reference sees the
    # float32 input the GPU sees (rounding 1000 + x to float32 moves a 4-value group's
    # normalized values by ~1e-4 by itself).
    x = (1000.0 + rng.standard_normal(shape)).astype(np.float32).astype(np.float64)
    w, b = mixed(rng, shape[1]), rng.standard_normal(shape[1])
    ref = cufused.group_norm(x, groups, w, b)
    out = poisoned(shape)
    cufused.group_norm(*to_gpu(x), groups, *to_gpu(w, b), out=out)
    assert_close(out.get(), ref, 1e-4)


# Channels-last inputs read in place (groups of 4, 8, 32 channels; 16-byte output vectors
# where H*W >= 4, scalar ones for (2, 16, 1, 3)) and one that is copied (groups of 3).
@pytest.mark.parametrize("shape,groups", [((3, 24, 5, 7), 3), ((2, 16, 1, 3), 4),
                                          ((2, 64, 9, 10), 2), ((2, 12, 4, 4), 4)])
def test_group_norm_channels_last_input(rng, shape, groups):
    from cufused._layout import empty_in_layout

    x = (1000.0 + rng.standard_normal(shape)).astype(np.float32).astype(np.float64)
    w, b = mixed(rng, shape[1]), rng.standard_normal(shape[1])
    ref = cufused.group_norm(x, groups, w, b)
    x_gpu = empty_in_layout(shape, "nhwc")
    x_gpu[...] = cp.asarray(x, dtype=cp.float32)
    out = poisoned(shape)
    cufused.group_norm(x_gpu, groups, *to_gpu(w, b), out=out)
    assert_close(out.get(), ref, 1e-4)


# Pipeline B's in-place GroupNorm: rows stored channels-last in blocks of one group's
# channels (16-byte output vectors for 9 x 10, scalar ones for 3 x 3 and 1 x 3), with and
# without the BatchNorm affine + tanh map first; and from a separate blocked buffer with two
# groups per block.
@pytest.mark.parametrize("shape,groups", [((3, 24, 9, 10), 6), ((2, 32, 3, 3), 2),
                                          ((2, 16, 1, 3), 4)])
@pytest.mark.parametrize("pre", [False, True])
def test_group_norm_rows_from_blocked_channels_last(rng, shape, groups, pre):
    from cufused._kernels.normalization import group_norm_rows

    n, c = shape[:2]
    x = (3.0 + rng.standard_normal(shape)).astype(np.float32).astype(np.float64)
    w, b = mixed(rng, c), rng.standard_normal(c)
    a_pre, b_pre = mixed(rng, c), rng.standard_normal(c)
    mapped = np.tanh(a_pre[:, None, None] * x + b_pre[:, None, None]) if pre else x
    ref = cufused.group_norm(mapped, groups, w, b)
    pre_gpu = tuple(to_gpu(a_pre, b_pre)) if pre else None
    for block, in_place in [(c // groups, True), (2 * c // groups, False)]:
        blocked = x.reshape(n, c // block, block, -1).transpose(0, 1, 3, 2)
        x_gpu = cp.asarray(np.ascontiguousarray(blocked).reshape(shape), dtype=cp.float32)
        out = x_gpu if in_place else poisoned(shape)
        group_norm_rows(x_gpu, out, groups, *to_gpu(w, b), 1e-5, pre=pre_gpu,
                        x_block=block)
        assert_close(out.get(), ref, 1e-4 if pre else 1e-5)


# (6, 7, 9, 11): scalar apply pass; (4, 7, 9, 11): 16-byte vectors that straddle the odd
# 99-value planes; (5, 3, 2): planes shorter than a vector.
@pytest.mark.parametrize("shape", [(6, 7, 9, 11), (4, 7, 9, 11), (5, 3, 2)])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("activation", [None, "tanh"])
def test_batch_norm(rng, shape, training, activation):
    x = 5.0 + 3.0 * rng.standard_normal(shape)
    c = shape[1]
    w, b = mixed(rng, c), rng.standard_normal(c)
    rm, rv = rng.standard_normal(c), rng.uniform(0.5, 2.0, c)
    rm_g, rv_g = to_gpu(rm, rv)
    ref = cufused.batch_norm(x, w, b, running_mean=rm, running_var=rv, training=training,
                             momentum=0.3, activation=activation)
    out = poisoned(x.shape)
    cufused.batch_norm(*to_gpu(x, w, b), running_mean=rm_g, running_var=rv_g,
                       training=training, momentum=0.3, activation=activation, out=out)
    assert_close(out.get(), ref, 1e-5)
    assert_close(rm_g.get(), rm, 1e-5)
    assert_close(rv_g.get(), rv, 1e-5)


@pytest.mark.parametrize("nd", [2, 3])
@pytest.mark.parametrize("is_max", [True, False])
def test_pooling(rng, nd, is_max):
    shape = (2, 3, 11, 13) if nd == 2 else (2, 3, 7, 9, 8)
    x = rng.standard_normal(shape)
    if is_max:
        x[0, 0, 1, 1] = np.nan
    fn = getattr(cufused, f"{'max' if is_max else 'avg'}_pool{nd}d")
    for opts in (dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1)):
        ref = fn(x, **opts)
        out = poisoned(ref.shape)
        fn(*to_gpu(x), **opts, out=out)
        got = out.get()
        assert np.array_equal(np.isnan(got), np.isnan(ref))
        mask = ~np.isnan(ref)
        assert_close(got[mask], ref[mask], 1e-6)


@pytest.mark.parametrize("nd", [2, 3])
@pytest.mark.parametrize("is_max", [True, False])
def test_pooling_into_channels_last(rng, nd, is_max):
    # The internal pool into a channels-last destination (pipeline C's conv input): 37
    # channels and 5 * 7 (* 3) positions leave partial 32 x 32 tiles; the 2-window kernel
    # writes it directly, the 3-window path pools into a temporary and transposes.
    from cufused._kernels.pooling import pool_into
    from cufused._layout import empty_in_layout
    from cufused._ops.pooling import check_pool_args

    shape = (2, 37, 10, 14) if nd == 2 else (2, 37, 6, 10, 14)
    x = rng.standard_normal(shape)
    x[1, 36, 1, 1] = np.nan
    fn = getattr(cufused, f"{'max' if is_max else 'avg'}_pool{nd}d")
    for opts in (dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1)):
        ref = fn(x, **opts)
        out = empty_in_layout(ref.shape, "nhwc")
        out[...] = cp.nan
        kernel, stride, padding, _ = check_pool_args(
            shape[2:], nd, opts["kernel_size"], opts.get("stride"), opts.get("padding", 0))
        pool_into(*to_gpu(x), out, kernel, stride, padding, is_max=is_max)
        got = out.get()
        assert np.array_equal(np.isnan(got), np.isnan(ref))
        mask = ~np.isnan(ref)
        assert_close(got[mask], ref[mask], 1e-6)


@pytest.mark.parametrize("shape,axis", [((3, 5, 7), -1), ((2, 3, 4, 5, 6), (2, 3, 4)),
                                        ((4, 6, 5), 1), ((2, 3, 4), (0, 2)), ((1000, 3), 0),
                                        ((2, 200_000), -1)])
def test_softmax(rng, shape, axis):
    x = 10 * rng.standard_normal(shape)
    ref = cufused.softmax(x, axis)
    out = poisoned(shape)
    cufused.softmax(*to_gpu(x), axis, out=out)
    assert_close(out.get(), ref, 1e-5)


@pytest.mark.parametrize("vec4", [True, False])
@pytest.mark.parametrize("clamp", [(-0.5, 1.5), (-80.0, 80.0)])  # no running max / online
@pytest.mark.parametrize("channels,length", [(4, 1000), (12, 999), (64, 1536), (256, 260)])
def test_softmax_rows_channels_last(rng, monkeypatch, channels, length, clamp, vec4):
    # Pipeline C's softmax over a channels-last (N, S, C) tensor: bias, clamp and scale fused,
    # the 16-byte statistics kernel (with 1 to 32 threads per position) or the scalar one,
    # and the 16-byte or the scalar transposing normalize pass.
    softmax_module = importlib.import_module("cufused._kernels.softmax")
    launched = []
    get_kernel = softmax_module.get_kernel
    monkeypatch.setattr(softmax_module, "get_kernel",
                        lambda f, name, **kw: launched.append(name) or get_kernel(f, name, **kw))
    n = 3
    y = 20 * rng.standard_normal((n, length, channels))
    y[1, 7, channels - 1] = np.nan
    bias, scale = rng.standard_normal(channels), rng.standard_normal(channels)
    v = np.clip(y + bias, *clamp)
    e = np.exp(v - v.max(axis=1, keepdims=True))
    ref = (e / e.sum(axis=1, keepdims=True) * scale).transpose(0, 2, 1)
    y_gpu, bias_gpu, scale_gpu = to_gpu(y, bias, scale)
    out = poisoned(ref.shape)
    softmax_module.softmax_rows(cp, y_gpu, out, n * channels, length, channels,
                                (length * channels, 1, channels), layout="nhwc",
                                bias=bias_gpu, scale=scale_gpu, clamp=clamp, vec4=vec4)
    uses_vec4 = vec4 and channels % 4 == 0
    assert any(k.startswith("softmax_stats_nhwc4") for k in launched) == uses_vec4
    assert ("softmax_apply_transpose4<true>" in launched) == (uses_vec4 and length % 4 == 0)
    got = out.get()
    assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.isnan(got[1, -1]).all()
    mask = ~np.isnan(ref)
    assert_close(got[mask], ref[mask], 1e-5)


def test_softmax_nan_and_inf():
    x = np.zeros((3, 4))
    x[0, 1] = np.nan
    x[1, 2] = -np.inf
    x[2, 3] = np.inf
    got = cufused.softmax(cp.asarray(x, dtype=cp.float32), axis=1).get()
    assert np.isnan(got[0]).all() and np.isnan(got[2]).all()
    assert_close(got[1], cufused.softmax(x, 1)[1], 1e-6)


# -------------------------------------------------------------------------------- pipelines


def pipeline_a_args(rng, n=3, cin=5, h=23, w=19, cout=12, k=3, groups=4, pool=4, sign=True):
    x = rng.random((n, cin, h, w))
    wt = rng.standard_normal((cout, cin, k, k)) * 0.3
    cb = rng.standard_normal(cout)
    gw = mixed(rng, cout) if sign else rng.random(cout)
    gb = rng.standard_normal(cout) * 0.5
    scale = mixed(rng, cout).reshape(cout, 1, 1) if sign else rng.random((cout, 1, 1))
    return (x, wt, cb, gw, gb, scale), dict(num_groups=groups, pool_kernel=pool,
                                            clamp_min=-0.5, clamp_max=0.7)


@pytest.mark.parametrize("method", ["fused", "unfused"])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("sign", [True, False])
def test_pipeline_a(rng, layout, method, precision, sign):
    arrays, opts = pipeline_a_args(rng, sign=sign)
    ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    out = poisoned(ref.shape)
    cufused.conv2d_groupnorm_scale_maxpool_clamp(*to_gpu(*arrays), **opts, method=method,
                                                 precision=precision, out=out)
    assert_close(out.get(), ref, 10 * TOL[precision])


def test_pipeline_a_dropped_rows_count_in_stats(rng, layout):
    # 126 // 4 = 31 windows; rows/cols 124-125 are pooled away but shape the statistics.
    arrays, opts = pipeline_a_args(rng, n=2, cin=3, h=128, w=128, cout=8, groups=2)
    x = arrays[0]
    x[:, :, 125:, :] += 50.0  # feeds only conv rows the pool drops
    ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    got = cufused.conv2d_groupnorm_scale_maxpool_clamp(*to_gpu(*arrays), **opts)
    assert_close(got.get(), ref, 1e-4)


def pipeline_b_args(rng, n=4, cin=6, h=9, w=7, cout=8, groups=2, conv_groups=1):
    x = rng.random((n, cin, h, w))
    wt = rng.standard_normal((cin, cout // conv_groups, 3, 3)) * 0.3
    return (x, wt, mixed(rng, cout), rng.standard_normal(cout), mixed(rng, cout),
            rng.standard_normal(cout)), dict(num_groups=groups, groups=conv_groups)


@pytest.mark.parametrize("method", ["fused", "unfused"])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_pipeline_b(rng, layout, method, precision):
    arrays, opts = pipeline_b_args(rng)
    cb = rng.standard_normal(8)
    rm, rv = rng.standard_normal(8), rng.uniform(0.5, 2, 8)
    rm_g, rv_g = to_gpu(rm, rv)
    opts.update(stride=2, padding=1, output_padding=1)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *arrays, **opts, conv_bias=cb, running_mean=rm, running_var=rv)
    out = poisoned(ref.shape)
    cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *to_gpu(*arrays), **opts, conv_bias=to_gpu(cb)[0], running_mean=rm_g,
        running_var=rv_g, method=method, precision=precision, out=out)
    assert_close(out.get(), ref, 10 * TOL[precision])
    assert_close(rm_g.get(), rm, 10 * TOL[precision])
    assert_close(rv_g.get(), rv, 10 * TOL[precision])


@pytest.mark.parametrize("cout", [64, 63])
def test_pipeline_b_large_groups_uncached(rng, layout, cout):
    # A (n, group) row of C * 17 * 17 floats exceeds the shared-memory cache: re-read path,
    # with 16-byte accesses (C = 64) and without (C = 63: odd row length).
    arrays, opts = pipeline_b_args(rng, n=2, cin=4, h=32, w=32, cout=cout, groups=1,
                                   conv_groups=1 if cout % 2 else 2)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*arrays, **opts)
    got = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*to_gpu(*arrays), **opts)
    assert_close(got.get(), ref, 1e-4)


def pipeline_c_args(rng, n=2, cin=3, d=8, h=10, w=6, cout=5, groups=1):
    x = rng.random((n, cin, d, h, w))
    wt = rng.standard_normal((cin, cout // groups, 3, 3, 3))
    return (x, wt, mixed(rng, cout).reshape(1, cout, 1, 1, 1)), dict(
        stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=0.0, clamp_max=1.0,
        groups=groups)


@pytest.mark.parametrize("method", ["fused", "unfused"])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("clamp", [(0.0, 1.0), (-50.0, 40.0)])
def test_pipeline_c(rng, layout, method, precision, clamp):
    arrays, opts = pipeline_c_args(rng)
    opts.update(clamp_min=clamp[0], clamp_max=clamp[1])
    cb = rng.standard_normal(5)
    ref = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(*arrays, **opts, conv_bias=cb)
    out = poisoned(ref.shape)
    cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
        *to_gpu(*arrays), **opts, conv_bias=to_gpu(cb)[0], method=method,
        precision=precision, out=out)
    # Outputs are tiny (~1 / (D*H*W)): only a relative check can tell them from zeros.
    assert rel_err(out.get(), ref) < 10 * TOL[precision]


def test_tanh_accuracy():
    # The kernels' branch-free tanh (through batch_norm's inference affine, a = 1, b = 0):
    # both sides of its 0.25 cutoff, tiny and saturated values, +-inf and NaN.
    x = np.concatenate([np.linspace(-12.0, 12.0, 400_001), [0.2499999, 0.25, 0.2500001],
                        [1e-30, -1e-8, 3e-4, np.inf, -np.inf, np.nan]]).astype(np.float32)
    xg = cp.asarray(x.reshape(1, 1, -1))
    ones, zeros = cp.ones(1, dtype=cp.float32), cp.zeros(1, dtype=cp.float32)
    got = cufused.batch_norm(xg, ones, zeros, running_mean=zeros, running_var=ones, eps=0.0,
                             training=False, activation="tanh").get().ravel()
    ref = np.tanh(x.astype(np.float64))
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    finite = ~np.isnan(ref)
    assert np.abs(got[finite] - ref[finite]).max() < 2e-7
    nonzero = finite & (ref != 0)
    assert (np.abs(got[nonzero] - ref[nonzero]) / np.abs(ref[nonzero])).max() < 6e-7


def test_transpose_channels_affine(rng):
    # Channels-last -> NCHW with clamp(scale[n, c] * v + shift[n, c]): 37 channels (partial
    # tiles), NaN kept, bounds applied.
    from cufused._kernels.layout import transpose_channels
    from cufused._layout import empty_in_layout

    n, c, h, w = 3, 37, 5, 7
    x = rng.standard_normal((n, c, h, w))
    x[1, 4, 2, 3] = np.nan
    scale, shift = rng.standard_normal((n, c)), rng.standard_normal((n, c))
    src = empty_in_layout(x.shape, "nhwc")
    src[...] = cp.asarray(x, dtype=cp.float32)
    out = poisoned(x.shape)
    transpose_channels(src, out, to_channels_last=False,
                       affine=(*to_gpu(scale.ravel(), shift.ravel()), -0.5, 0.75))
    ref = np.clip(scale[:, :, None, None] * x + shift[:, :, None, None], -0.5, 0.75)
    got = out.get()
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    assert_close(np.nan_to_num(got), np.nan_to_num(ref), 1e-6)


@pytest.mark.parametrize("shape", [(3, 20, 9, 12), (2, 37, 5, 7), (1, 4, 2_200_000)])
def test_transpose_channels_both_ways(rng, shape):
    # NCHW -> channels-last and back (+ bias), partial tiles; the last shape has more than
    # 65535 tiles of positions per sample (once past the grid's y limit).
    from cufused._kernels.layout import transpose_channels
    from cufused._layout import empty_in_layout

    x = cp.asarray(rng.standard_normal(shape), dtype=cp.float32)
    bias = cp.asarray(rng.standard_normal(shape[1]), dtype=cp.float32)
    nhwc = empty_in_layout(shape, "nhwc")
    nhwc.fill(cp.nan)
    transpose_channels(x, nhwc, to_channels_last=True)
    assert bool((nhwc == x).all())
    back = poisoned(shape)
    transpose_channels(nhwc, back, to_channels_last=False, bias=bias)
    assert bool((back == x + bias.reshape(1, -1, *[1] * (len(shape) - 2))).all())


def test_pipeline_b_odd_group_rows(rng, layout):
    # One channel of 5 * 5 pooled values per group: rows too short for 16-byte accesses.
    arrays, opts = pipeline_b_args(rng, h=8, w=8, cout=8, groups=8)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*arrays, **opts)
    out = poisoned(ref.shape)
    cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*to_gpu(*arrays), **opts, out=out)
    assert_close(out.get(), ref, 1e-4)


@pytest.mark.parametrize("layout,pool,c,h,w,variants", [
    ("nchw", 2, 12, 22, 18, ["bands"]),
    ("nchw", 4, 12, 22, 18, ["bands"]),
    ("nchw", 2, 8, 70, 42, ["bands"]),  # three chunks of 15 bands, 21 windows per band
    ("nchw", 2, 4, 11, 80, ["bands"]),  # 40 windows per band: more than a warp
    # Channels-last: 1 to 32 channel quads per warp; ">nhwc" writes ext channels-last,
    # ">blocked" channels-last in blocks of 4 channels and of a statistics group's channels.
    ("nhwc", 2, 128, 9, 41, ["vec4", "vec4>nhwc", "vec4>blocked", "rows"]),
    ("nhwc", 4, 64, 13, 30, ["vec4", "rows", "rows>nhwc", "rows>blocked"]),
    ("nhwc", 4, 32, 9, 10, ["rows", "rows>nhwc"]),
    ("nhwc", 4, 16, 22, 18, ["vec4"]),
    ("nhwc", 2, 4, 6, 7, ["vec4", "vec4>nhwc"]),
])
def test_fused_pass_variants_match_scalar(rng, layout, pool, c, h, w, variants):
    # The 16-byte kernels against the scalar one and float64 sums: mixed extremum signs, a
    # bias, statistics rows of c / 4 channels per sample (partial channel tiles for c = 12),
    # rows and columns the pool drops.
    from cufused._kernels import pooling
    from cufused._layout import empty_in_layout

    n, group = 3, max(c // 4, 1)
    y_host = 5.0 + rng.standard_normal((n, c, h, w))
    y = empty_in_layout(y_host.shape, layout)
    y[...] = cp.asarray(y_host, dtype=cp.float32)
    bias, sign = to_gpu(rng.standard_normal(c), mixed(rng, c))
    results = {}
    ext_shape = (n, c, h // pool, w // pool)
    for variant in ["scalar", *variants]:
        kernel, _, ext_layout = variant.partition(">")
        for block in ([4, group] if ext_layout == "blocked" else [None]):
            if ext_layout == "nhwc":
                ext = empty_in_layout(ext_shape, "nhwc")
                ext[...] = cp.nan
            else:
                ext = poisoned(ext_shape)
            partial, shift, _ = pooling.pool_extremum_stats(
                cp, y, ext, pool, bias=bias, sign_a=sign, sign_b=None, shift_group=group,
                per_sample=True, variant=pooling.fused_pass_variant(y, pool, kernel),
                ext_block=block)
            ext = ext.get()
            if block:  # (N, C / block, P, block) memory -> NCHW
                ext = (ext.reshape(n, c // block, -1, block).transpose(0, 1, 3, 2)
                       .reshape(ext_shape))
            results[variant if block in (None, 4) else f"{variant} {block}"] = (
                ext, partial.get().sum(axis=2), shift.get())
    ext_s, sums_s, shift_s = results["scalar"]
    assert not np.isnan(ext_s).any()
    d = (y.get().astype(np.float64) + bias.get()[:, None, None]
         - np.repeat(shift_s.reshape(n, -1), group, axis=1)[:, :, None, None])
    assert_close(sums_s[..., 0], d.sum(axis=(2, 3)), 1e-5)
    assert_close(sums_s[..., 1], (d * d).sum(axis=(2, 3)), 1e-5)
    assert len(results) == 1 + len(variants) + sum(v.endswith(">blocked") for v in variants)
    for variant in set(results) - {"scalar"}:
        ext_v, sums_v, shift_v = results[variant]
        assert np.array_equal(ext_v, ext_s), variant
        assert np.array_equal(shift_v, shift_s), variant
        assert_close(sums_v, sums_s, 1e-5)


@pytest.mark.parametrize("pipeline,cout", [("A", 32), ("A", 64), ("B", 64), ("B", 128)])
def test_pipeline_channels_last_window_rows(rng, pipeline, cout):
    # C_out in {32, 64, 128}, channels-last, with rows and columns the pool drops. A (pool 4):
    # the fused pass reads whole window rows per warp; B (pool 2): 16-byte channel quads, the
    # pooled extrema stored channels-last and read so by the GroupNorm.
    if pipeline == "A":
        arrays, opts = pipeline_a_args(rng, cout=cout, groups=8)
        fn = cufused.conv2d_groupnorm_scale_maxpool_clamp
    else:
        arrays, opts = pipeline_b_args(rng, cout=cout, groups=4)
        fn = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm
    ref = fn(*arrays, **opts)
    out = poisoned(ref.shape)
    with _pinned("nhwc"):
        fn(*to_gpu(*arrays), **opts, out=out)
    assert_close(out.get(), ref, 10 * TOL["ieee"])


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_pipeline_c_channels_last_vectorized(rng, precision):
    # C_out % 4 == 0 and D*H*W % 4 == 0: the 16-byte transposing normalize pass runs.
    arrays, opts = pipeline_c_args(rng, cout=8)
    ref = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(*arrays, **opts)
    out = poisoned(ref.shape)
    with _pinned("nhwc"):
        cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
            *to_gpu(*arrays), **opts, precision=precision, out=out)
    assert rel_err(out.get(), ref) < 10 * TOL[precision]


@pytest.mark.parametrize("pin", ["subpixel nchw", "nchw"])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_pipeline_c_one_read(rng, monkeypatch, pin, precision):
    # Output D = 16 (whole planes for each of a cluster's 8 blocks) and H * W % 4 == 0: the
    # one-read cluster kernel normalizes the class blocks ("subpixel nchw") or the NCDHW rows
    # ("nchw"). A NaN input turns its sample's rows to NaN.
    softmax_module = importlib.import_module("cufused._kernels.softmax")
    chosen = []
    one_read_geometry = softmax_module.one_read_geometry
    monkeypatch.setattr(softmax_module, "one_read_geometry",
                        lambda *args: chosen.append(one_read_geometry(*args)) or chosen[-1])
    arrays, opts = pipeline_c_args(rng, n=3, cin=4, d=16, h=12, w=4, cout=6)
    arrays[0][2, 1, 3, 5, 1] = np.nan
    cb = rng.standard_normal(6)
    ref = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(*arrays, **opts, conv_bias=cb)
    out = poisoned(ref.shape)
    with _pinned(pin):
        cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
            *to_gpu(*arrays), **opts, conv_bias=to_gpu(cb)[0], precision=precision, out=out)
    assert chosen and chosen[-1] is not None
    got = out.get()
    assert np.isnan(ref[2]).all() and np.array_equal(np.isnan(got), np.isnan(ref))
    mask = ~np.isnan(ref)
    assert rel_err(got[mask], ref[mask]) < 10 * TOL[precision]


@pytest.mark.parametrize("method", ["fused", "unfused"])
def test_pipeline_b_nan_reaches_running_buffers(rng, method):
    # A NaN input value reaches every channel's batch statistics: every output and both running
    # buffers turn NaN, as in PyTorch (the variance's clamp at 0 must not drop the NaN).
    arrays, opts = pipeline_b_args(rng)
    arrays[0][1, 0, 3, 4] = np.nan
    rm, rv = rng.standard_normal(8), rng.uniform(0.5, 2, 8)
    rm_g, rv_g = to_gpu(rm, rv)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *arrays, **opts, running_mean=rm, running_var=rv)
    got = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *to_gpu(*arrays), **opts, running_mean=rm_g, running_var=rv_g, method=method)
    for expected, result in ((ref, got), (rm, rm_g), (rv, rv_g)):
        assert np.isnan(expected).all() and np.isnan(result.get()).all()


def test_pipelines_propagate_nan(rng):
    arrays, opts = pipeline_a_args(rng)
    arrays[0][1, 2, 5, 5] = np.nan
    ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    got = cufused.conv2d_groupnorm_scale_maxpool_clamp(*to_gpu(*arrays), **opts).get()
    assert np.isnan(ref[1]).all() and np.array_equal(np.isnan(got), np.isnan(ref))
    arrays, opts = pipeline_c_args(rng)
    arrays[0][0, 0, 0, 0, 0] = np.inf
    ref = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(*arrays, **opts)
    got = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(*to_gpu(*arrays), **opts)
    got = got.get()
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    mask = ~np.isnan(ref)
    assert rel_err(got[mask], ref[mask]) < 1e-4


def test_empty_batch():
    x = cp.empty((0, 5, 9, 9), dtype=cp.float32)
    w, ones = to_gpu(np.ones((8, 5, 3, 3)), np.ones(8))
    got = cufused.conv2d_groupnorm_scale_maxpool_clamp(
        x, w, None, ones, None, ones, num_groups=2, pool_kernel=2, clamp_min=0, clamp_max=1)
    assert got.shape == (0, 8, 3, 3)


def test_pipeline_capture_in_cuda_graph(rng, layout):
    arrays, opts = pipeline_a_args(rng)
    garrays = to_gpu(*arrays)
    ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out = cp.empty(ref.shape, dtype=cp.float32)
        cufused.conv2d_groupnorm_scale_maxpool_clamp(*garrays, **opts, out=out)  # warm
        stream.begin_capture()
        cufused.conv2d_groupnorm_scale_maxpool_clamp(*garrays, **opts, out=out)
        graph = stream.end_capture()
        out.fill(cp.nan)
        graph.launch()
    stream.synchronize()
    assert_close(out.get(), ref, 1e-4)


def test_tensor_past_2_31_elements(rng):
    # (n, 1, 256, 256) with n = 2**15 + 1: 2**31 + 65536 elements. Each sample is independent,
    # so the first and last samples are checked against the reference.
    n = 2**15 + 1
    x = cp.random.default_rng(int(rng.integers(2**31))).random((n, 1, 256, 256),
                                                              dtype=cp.float32)
    assert x.size > 2**31
    x[-1, 0, 7, 9] = 9.0
    for fn, kwargs in ((cufused.max_pool2d, dict(kernel_size=2)),
                       (cufused.group_norm, dict(num_groups=1)),
                       (cufused.softmax, dict(axis=(2, 3)))):
        y = fn(x, **kwargs)
        for i in (0, n - 1):
            ref = fn(x[i:i + 1].get(), **kwargs)
            assert_close(y[i:i + 1].get(), ref, 1e-5)
        del y
    del x
    cp.get_default_memory_pool().free_all_blocks()


def test_pipeline_a_sample_past_2_31_elements(rng):
    # One sample whose convolution output has 64 * 5798**2 > 2**31 elements: the fused pass
    # indexes within a sample in 32 bits, so the call takes the unfused blocks; checked against
    # PyTorch CUDA in float32 (a float64 reference of 2**31 values would not fit the test).
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    F = torch.nn.functional
    x = cp.random.default_rng(int(rng.integers(2**31))).random((1, 1, 5800, 5800),
                                                              dtype=cp.float32)
    w, b, gw, gb, s = to_gpu(rng.standard_normal((64, 1, 3, 3)), rng.standard_normal(64),
                             mixed(rng, 64), rng.standard_normal(64), mixed(rng, 64))
    got = cufused.conv2d_groupnorm_scale_maxpool_clamp(
        x, w, b, gw, gb, s, num_groups=16, pool_kernel=4, clamp_min=-0.5, clamp_max=0.5)
    t = [torch.from_dlpack(a) for a in (x, w, b, gw, gb, s)]
    with torch.backends.cudnn.flags(allow_tf32=False):
        y = F.group_norm(F.conv2d(t[0], t[1], t[2]), 16, t[3], t[4]) * t[5].view(1, -1, 1, 1)
        want = torch.clamp(F.max_pool2d(y, 4), -0.5, 0.5)
    del y
    assert_close(got.get(), want.cpu().numpy(), 1e-4)
    del got, want, t, x
    cp.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------- canonical shapes


def test_canonical_pipelines_match_torch_cuda(rng):
    from cufused._cudnn import plan_options

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    from cufused.bench.cases import CASES, torch_reference

    for case in CASES:
        inputs = case.make_inputs(np.random.default_rng(int(rng.integers(2**31))))
        for precision in ("ieee", "tf32"):
            with plan_options(autotune=True):  # the plans the benchmark uses
                got = case.run_cufused(inputs, precision=precision).get()
            ref = torch_reference(case, inputs)
            err = rel_err(got, ref)
            assert err < 10 * TOL[precision], (case.name, precision, err)
