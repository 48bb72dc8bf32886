"""cuDNN plans on the GPU: CUDA-graph replay and its decision, the graphs' memory pool,
autotuning over layouts and the sub-pixel split (private: cufused._cudnn's plan cache)."""

from __future__ import annotations

import pytest

import cufused
from cufused import _settings

from conftest import GPU, CONV_CASES, TOL, _pinned, assert_close, to_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("quick_plans")]

if GPU:
    import cupy as cp


@pytest.fixture
def plan_graphs_only():
    """Public calls run as calls nested in a whole-call graph do: the plans' own graph replay
    is what runs (cufused._call_graphs otherwise captures the whole call)."""
    from cufused import _call_graphs

    token = _call_graphs._inside.set(True)
    yield
    _call_graphs._inside.reset(token)


@pytest.mark.parametrize("case", [CONV_CASES[0], CONV_CASES[5], CONV_CASES[7]],
                         ids=["2d", "2dT", "3dT"])
def test_conv_plan_replays_graph(rng, case, conv_pin, plan_graphs_only):
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
    with _settings.plan_options(replay=False):
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


def test_replay_reads_this_calls_copy_of_a_misaligned_bias(rng, plan_graphs_only,
                                                           monkeypatch):
    # A bias 4 bytes past a 16-byte boundary reaches cuDNN's graph as an aligned copy made
    # outside the plan's CUDA graph: a replay must read this call's copy, not the freed block
    # of the capturing call's, which other arrays (filled with 1e6 here) take over. The
    # autotuner, which keeps the bias in the graph where that is faster, is made to keep it.
    from cufused import _cudnn
    from cufused._cudnn import _autotune

    monkeypatch.setattr(_autotune, "strategy_score",
                        lambda cost, strategy, convert_input: float(not strategy.bias_in_graph))

    x, w = to_gpu(rng.standard_normal((2, 8, 12, 12)), rng.standard_normal((16, 8, 3, 3)))
    b = cp.asarray(rng.standard_normal(17), dtype=cp.float32)[1:]
    assert b.data.ptr % 16 == 4
    out = cp.empty((2, 16, 10, 10), dtype=cp.float32)
    with _settings.plan_options(autotune=True, pins=("nchw+bias",)):
        for _ in range(3):
            cufused.conv2d(x, w, b, out=out)
        plan = [p for p in _cudnn._plans.values() if p is not None and p.problem.bias][-1]
        assert plan.strategy.bias_in_graph and plan._replays
        taken = [cp.full(16, 1e6, dtype=cp.float32) for _ in range(64)]
        for _ in range(3):
            b_new = rng.standard_normal(16)
            b[...] = cp.asarray(b_new, dtype=cp.float32)
            out.fill(cp.nan)
            cufused.conv2d(x, w, b, out=out)
            assert_close(out.get(), cufused.conv2d(x.get().astype("float64"),
                                                   w.get().astype("float64"), b_new), TOL["ieee"])
    assert all(float(t.min()) == 1e6 for t in taken)


def test_replay_decision_without_memory_for_a_flush(monkeypatch):
    # With no room for the L2 flush buffer the autotuner times unflushed instead of failing.
    from cufused import _timing

    def out_of_memory(*args, **kwargs):
        raise cp.cuda.memory.OutOfMemoryError(1 << 40, 0)

    monkeypatch.setattr(cp, "empty", out_of_memory)
    assert _timing.l2_flush_buffer() is None


def test_graph_buffers_leave_the_default_pool_alone(rng, plan_graphs_only):
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


def test_graph_buffers_within_the_device_budget(rng, plan_graphs_only, monkeypatch):
    # The plans' graphs keep at most KEPT_FRACTION of the device's memory in buffers: a new
    # graph drops the oldest (another operand's, another plan's) until it fits, and one that
    # cannot fit alone is not captured, its calls running directly with the same results.
    from cufused import _cudnn
    from cufused._arrays import _memory_limit
    from cufused._cudnn import _plan

    xs, ws = (2, 6, 9, 7), (6, 4, 3, 3)
    xg, wg = to_gpu(rng.standard_normal(xs), rng.standard_normal(ws))
    outs = [cp.empty((2, 4, 11, 9), dtype=cp.float32) for _ in range(3)]
    cufused.clear_plan_cache()
    with _pinned("nhwc"):
        for _ in range(2):
            cufused.conv_transpose2d(xg, wg, out=outs[0])
        plan = [p for k, p in _cudnn._plans.items() if k[1].x_shape == xs][-1]
        (kept,) = _plan._kept_bytes.values()
        assert len(plan._replays) == 1 and kept > 0
        # Room for one graph: the next operands' graph replaces the first.
        monkeypatch.setattr(_plan, "KEPT_FRACTION", 1.5 * kept / _memory_limit(cp))
        for _ in range(2):
            cufused.conv_transpose2d(xg, wg, out=outs[1])
        assert len(plan._replays) == 1 and list(_plan._kept_bytes.values()) == [kept]
        # Room for none: the calls run directly.
        monkeypatch.setattr(_plan, "KEPT_FRACTION", 0.5 * kept / _memory_limit(cp))
        for _ in range(3):
            outs[2].fill(cp.nan)
            cufused.conv_transpose2d(xg, wg, out=outs[2])
        assert len(plan._replays) == 1
    want = cufused.conv_transpose2d(xg.get().astype(float), wg.get().astype(float))
    for out in outs:
        assert_close(out.get(), want, TOL["ieee"])
    cufused.clear_plan_cache()
    assert not _plan._kept and not _plan._kept_bytes


@pytest.mark.parametrize("direct_wins", [False, True])
def test_autotuned_plan_replay_decision(rng, monkeypatch, plan_graphs_only, direct_wins):
    # The autotuner times its chosen plan replayed and issued directly and keeps direct calls
    # only where they win (_direct_wins). Which way a tiny convolution's timings fall is a
    # measurement of the host, so each outcome is forced here (the rule itself is
    # unit-tested in test_conv_keys). Either way none of the graphs of the autotuner's
    # operands is kept; a replaying plan then captures one graph for the caller's operands,
    # a direct one none (the calls as a whole-call graph's capture makes them: nested).
    from cufused import _cudnn
    from cufused._cudnn import _autotune

    monkeypatch.setattr(_autotune, "_direct_wins", lambda *medians: direct_wins)
    cufused.clear_plan_cache()  # so that the plan is autotuned under this rule
    xs, ws = (2, 3, 9, 13), (5, 3, 3, 3)
    xg, wg = to_gpu(rng.standard_normal(xs), rng.standard_normal(ws))
    with _settings.plan_options(autotune=True, replay=True):
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


def test_conv_autotune_times_both_layouts(rng):
    from cufused import _cudnn

    x = rng.standard_normal((2, 3, 9, 9))
    w = rng.standard_normal((4, 3, 2, 2))
    with _settings.plan_options(autotune=True):
        got = cufused.conv2d(*to_gpu(x, w), stride=2)
    assert_close(got.get(), cufused.conv2d(x, w, stride=2), TOL["ieee"])
    plans = [p for k, p in _cudnn._plans.items() if k[1].x_shape == (2, 3, 9, 9) and k[5]]
    assert len(plans) == 1 and len(plans[0].candidates) >= 3  # NCHW, NHWC, NCHW -> NHWC
    assert min(cost for _, cost in plans[0].candidates.values()) == plans[0].cost


@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_conv_autotune_skips_the_engines_that_fault(rng, monkeypatch, precision):
    # The autotuner runs every plan of every strategy, the bias inside the graph included,
    # whose cuDNN engine 52 faulted on this grouped problem (misaligned address: every later
    # CUDA call of the process then failed; fuzz_blocks). No such plan runs: the result is
    # the reference's, and the device still works.
    from cufused import _cudnn
    from cufused._cudnn import _graphs

    ran, execute = [], _graphs._Part.execute

    def recorded(part, *args, **kwargs):
        ran.append((part.spec.bias_strides is not None,
                    part.graph.get_plan_name_at_index(part.plan_index).split("_")[0]))
        return execute(part, *args, **kwargs)

    monkeypatch.setattr(_graphs._Part, "execute", recorded)
    x, w, b = (rng.standard_normal(s) for s in ((2, 6, 2, 1), (12, 2, 4, 1), (12,)))
    opts = dict(stride=3, padding=(2, 1), groups=3)
    with _settings.plan_options(autotune=True):
        got = cufused.conv2d(*to_gpu(x, w, b), **opts, precision=precision)
    cp.cuda.runtime.deviceSynchronize()
    assert_close(got.get(), cufused.conv2d(x, w, b, **opts), TOL[precision])
    assert (True, "eng52") not in ran and any(in_graph for in_graph, _ in ran)
    plans = [p for k, p in _cudnn._plans.items()
             if k[1].x_shape == (2, 6, 2, 1) and k[1].precision == precision and k[5]]
    assert len(plans) == 1 and any("+bias" in label for label in plans[0].candidates)


def test_conv_autotune_weighs_subpixel_split(rng):
    from cufused import _cudnn

    x = rng.standard_normal((2, 4, 4, 6, 8))
    w = rng.standard_normal((4, 3, 3, 3, 3))
    opts = dict(stride=2, padding=1, output_padding=1)
    with _settings.plan_options(autotune=True):
        got = cufused.conv_transpose3d(*to_gpu(x, w), **opts)
    assert_close(got.get(), cufused.conv_transpose3d(x, w, **opts), TOL["ieee"])
    plans = [p for k, p in _cudnn._plans.items() if k[1].x_shape == (2, 4, 4, 6, 8) and k[5]]
    assert len(plans) == 1 and "subpixel nchw" in plans[0].candidates


def test_conv_autotune_without_memory_for_its_operands(rng, monkeypatch):
    # Where the timing operands do not fit beside the caller's (a problem near the device's
    # memory), the plan is the first that builds, untimed, and the call still runs.
    from cufused import _cudnn
    from cufused._cudnn import _autotune

    def out_of_memory(*args, **kwargs):
        raise cp.cuda.memory.OutOfMemoryError(1 << 40, 0)

    monkeypatch.setattr(_autotune, "random_operand", out_of_memory)
    x, w = rng.standard_normal((2, 3, 10, 7)), rng.standard_normal((5, 3, 3, 2))
    with _settings.plan_options(autotune=True):
        got = cufused.conv2d(*to_gpu(x, w), padding=1)
    assert_close(got.get(), cufused.conv2d(x, w, padding=1), TOL["ieee"])
    plans = [p for k, p in _cudnn._plans.items() if k[1].x_shape == x.shape and k[5]]
    assert len(plans) == 1 and plans[0] is not None and plans[0].candidates == {}
