"""CPU-side convolution logic: output shapes, plan cache keys, layout strides, the choice
between CUDA-graph replay and direct calls."""

from __future__ import annotations

import types

import numpy as np
import pytest

from cufused._cudnn import ConvProblem
from cufused._layout import layout_strides
from cufused._ops._conv_args import check_conv_args

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("transposed,opts", [
    (False, dict(stride=1, padding=0)), (False, dict(stride=2, padding=1)),
    (False, dict(stride=(3, 1), padding=(0, 2), dilation=(2, 1))),
    (True, dict(stride=1, padding=0)), (True, dict(stride=2, padding=1, output_padding=1)),
    (True, dict(stride=(3, 1), padding=(0, 2), dilation=(2, 1), output_padding=(2, 0))),
])
def test_output_shape_matches_torch(transposed, opts):
    x_shape = (2, 4, 11, 9)
    w_shape = (4, 6, 3, 3) if transposed else (6, 4, 3, 3)
    args = check_conv_args(x_shape, w_shape, 2, transposed=transposed, **opts)
    fn = torch.nn.functional.conv_transpose2d if transposed else torch.nn.functional.conv2d
    ref = fn(torch.zeros(x_shape), torch.zeros(w_shape), **opts).shape
    assert args.out_shape == tuple(ref)


def test_checked_arguments_cache_keys_the_option_names():
    from cufused._ops._conv_args import cached_conv_args

    # The same values under other names (keywords in another order) are another call.
    x_shape, w_shape = (1, 2, 13, 13), (3, 2, 3, 3)
    first = cached_conv_args(x_shape, w_shape, 2, transposed=False, stride=2, padding=1)
    second = cached_conv_args(x_shape, w_shape, 2, transposed=False, padding=2, stride=1)
    assert first.out_shape == (1, 3, 7, 7)
    assert second.out_shape == (1, 3, 15, 15)
    assert second == check_conv_args(x_shape, w_shape, 2, transposed=False, stride=1,
                                     padding=2)


def test_plan_options_restore_only_what_they_change():
    import cufused
    from cufused._settings import _config, plan_options

    saved = dict(_config)
    try:
        with plan_options(replay=True):  # meanwhile another thread switches autotuning off
            cufused.set_conv_autotune(False)
        assert _config["autotune"] is False and _config["replay"] == saved["replay"]
        with plan_options(engine="igemm", autotune=True):
            cufused.set_conv_graph_replay(False)
            assert _config["engine"] == "igemm" and _config["autotune"] is True
        assert _config["replay"] is False and _config["engine"] == saved["engine"]
        assert _config["autotune"] is False
    finally:
        _config.update(saved)


def test_plan_cache_key_separates_what_changes_the_plan():
    base = dict(kind="fprop", x_shape=(1, 3, 8, 8), w_shape=(4, 3, 3, 3), y_shape=(1, 4, 6, 6),
                stride=(1, 1), padding=(0, 0), dilation=(1, 1), precision="ieee")
    a, b = ConvProblem(**base), ConvProblem(**base)
    assert a == b and hash(a) == hash(b)
    for field, value in [("precision", "tf32"), ("kind", "dgrad"), ("stride", (2, 1)),
                         ("x_shape", (2, 3, 8, 8))]:
        assert ConvProblem(**{**base, field: value}) != a


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 3, 4, 5, 6), (1, 1, 1, 1)])
def test_layout_strides_match_numpy_transposes(shape):
    nd = len(shape)
    a = np.empty(shape)
    assert layout_strides(shape, "nchw") == tuple(s // 8 for s in a.strides)
    physical = np.empty((shape[0], *shape[2:], shape[1]))
    view = physical.transpose(0, nd - 1, *range(1, nd - 1))
    assert view.shape == shape
    assert layout_strides(shape, "nhwc") == tuple(s // 8 for s in view.strides)


@pytest.mark.parametrize("replayed,direct,replayed_issue,direct_issue,wins", [
    (1.000, 1.000, 0.03, 0.03, False),  # a tie keeps replay
    (1.004, 1.000, 0.03, 0.03, False),  # inside the margin
    (1.009, 1.000, 0.03, 0.03, True),   # faster on the device, at the same host cost
    (2.378, 2.357, 0.03, 0.66, False),  # B's FFT plan (H200): 21 us saved, 630 us of host
    (2.378, 1.000, 0.03, 0.66, True),   # a device gain beyond the host cost
    (0.500, 1.000, 0.03, 0.03, False),  # a host-bound plan
])
def test_direct_wins_only_beyond_margin_and_host_cost(replayed, direct, replayed_issue,
                                                      direct_issue, wins):
    from cufused._cudnn import _autotune

    assert _autotune._direct_wins(replayed, direct, replayed_issue, direct_issue) is wins


@pytest.mark.parametrize("direct_wins", [False, True])
def test_decide_replay_times_both_ways_alternately(monkeypatch, direct_wins):
    from cufused import _cudnn, _settings
    from cufused._cudnn import _autotune, _plan

    plan = types.SimpleNamespace(_replays={"autotune operands": "graph"},
                                 _calls={"other operands": 1})
    plan.drop_replays = types.MethodType(_plan.ConvPlan.drop_replays, plan)
    seen, issued = [], []

    def fake_time_ms(call, repeat, batch, flush):
        assert (repeat, batch, flush) == (1, 1, "flush")  # single calls after an L2 flush
        assert _settings._config["replay"] is True  # this thread's plans only, not the process's
        seen.append(_plan._timed_replay.get())
        call()
        return 1.0 if _plan._timed_replay.get() else 0.5

    def fake_issue_ms(call):
        issued.append(_plan._timed_replay.get())
        call()
        return 0.01 if _plan._timed_replay.get() else 0.02

    def fake_direct_wins(*medians):
        assert medians == (1.0, 0.5, 0.01, 0.02)  # replayed, direct, and their host times
        return direct_wins

    monkeypatch.setattr(_autotune, "time_ms", fake_time_ms)
    monkeypatch.setattr(_autotune, "issue_ms", fake_issue_ms)
    monkeypatch.setattr(_autotune, "_direct_wins", fake_direct_wins)
    monkeypatch.setattr(_autotune, "l2_flush_buffer", lambda: "flush")
    calls = []
    _cudnn._decide_replay(plan, lambda: calls.append(1), rounds=3)
    assert seen == issued == [True, False] * 3 and len(calls) == 12
    assert _settings._config["replay"] is True and _plan._timed_replay.get() is None
    assert plan._calls == {}
    assert plan._replays == (None if direct_wins else {})


@pytest.mark.parametrize("convert_output", [True, False])
def test_autotuner_measures_replay_of_every_plan(monkeypatch, convert_output):
    # Public plans and pipeline plans (output for a fused pass) alike: replayed or direct is
    # measured; with autotuning off it is not.
    from cufused import _cudnn
    from cufused._cudnn import _autotune

    problem = _cudnn.ConvProblem("fprop", (1, 2, 5, 5), (3, 2, 3, 3), (1, 3, 3, 3), (1, 1),
                                 (0, 0), (1, 1), "ieee")
    plan = types.SimpleNamespace(parts=[types.SimpleNamespace(milliseconds=1.0)],
                                 apply=lambda *args, **kwargs: None, _replays={})
    monkeypatch.setattr(_autotune, "strategies",
                        lambda problem, accept: [_cudnn.Strategy("direct", "nchw", "nchw")])
    monkeypatch.setattr(_autotune, "_make_plan", lambda problem, strategy, tune: plan)
    monkeypatch.setattr(_autotune, "random_operand", lambda shape, layout="nchw": None)
    monkeypatch.setattr(_autotune, "time_ms", lambda call: 1.0)
    decided = []
    monkeypatch.setattr(_autotune, "_decide_replay", lambda p, call: decided.append(p))
    best = _cudnn._choose(problem, True, convert_output, False, True, None)
    assert best is plan and best.candidates == {"nchw": (1.0, 1.0)}
    assert decided == [plan]
    assert _cudnn._choose(problem, True, convert_output, False, False, None) is plan
    assert decided == [plan]


@pytest.mark.parametrize("pins, built", [
    (None, ["nchw"]),  # untimed: the first strategy without the bias in its graph
    (("nchw+bias",), ["nchw+bias"]),  # a pinned bias-in-graph strategy is the one built
])
def test_untimed_choice_builds_the_pinned_strategy(monkeypatch, pins, built):
    from cufused import _cudnn
    from cufused._cudnn import _autotune

    problem = _cudnn.ConvProblem("fprop", (1, 2, 5, 5), (3, 2, 3, 3), (1, 3, 3, 3), (1, 1),
                                 (0, 0), (1, 1), "ieee", bias=True)
    monkeypatch.setattr(_autotune, "strategies", lambda problem, accept: [
        _cudnn.Strategy("direct", "nchw", "nchw", bias_in_graph=True),
        _cudnn.Strategy("direct", "nchw", "nchw")])
    made = []

    def make_plan(problem, strategy, tune):
        made.append(strategy.label)
        return types.SimpleNamespace(strategy=strategy)

    monkeypatch.setattr(_autotune, "_make_plan", make_plan)
    plan = _cudnn._choose(problem, True, True, False, False, pins)
    assert made == built and plan.strategy.label == built[0]


def test_autotuning_out_of_memory_chooses_untimed(monkeypatch):
    # Timing operands that do not fit make the choice the first plan that builds, untimed;
    # an untimed choice that runs out of memory (or any other error) is not retried.
    cupy = pytest.importorskip("cupy")
    from cufused._cudnn import _autotune

    calls = []

    def choose(problem, convert_input, convert_output, accept_classes, tune, pins):
        calls.append(tune)
        if problem == "workspaces" and tune:
            raise _autotune._ShortOfMemory(problem)
        if tune or problem == "unfit":
            raise cupy.cuda.memory.OutOfMemoryError(1 << 40, 0)
        return "untimed plan"

    monkeypatch.setattr(_autotune, "_choose", choose)
    assert _autotune._choose_fitting("p", True, False, False, True, None) == "untimed plan"
    assert calls == [True, False]
    assert _autotune._choose_fitting("workspaces", True, False, False, True, None) == \
        "untimed plan"
    assert calls == [True, False, True, False]
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
        _autotune._choose_fitting("unfit", True, False, False, False, None)
    assert calls == [True, False, True, False, False]


def test_strategies_short_of_memory_are_skipped(monkeypatch):
    # A strategy whose every plan was skipped for its workspace gives way to the next; where
    # none is left the search reports the shortage (not "unsupported", which is remembered).
    from cufused import _cudnn
    from cufused._cudnn import _autotune

    problem = _cudnn.ConvProblem("fprop", (1, 2, 5, 5), (3, 2, 3, 3), (1, 3, 3, 3), (1, 1),
                                 (0, 0), (1, 1), "ieee")
    plan = types.SimpleNamespace(parts=[types.SimpleNamespace(milliseconds=1.0)],
                                 apply=lambda *args, **kwargs: None, _replays={})
    found = [_cudnn.Strategy("direct", "nchw", "nchw"), _cudnn.Strategy("direct", "nhwc", "nhwc")]
    monkeypatch.setattr(_autotune, "strategies", lambda problem, accept: found)
    monkeypatch.setattr(_autotune, "random_operand", lambda shape, layout="nchw": None)
    monkeypatch.setattr(_autotune, "time_ms", lambda call: 1.0)
    monkeypatch.setattr(_autotune, "_decide_replay", lambda p, call: None)
    made = {"nchw": _autotune._SHORT_OF_MEMORY, "nhwc": plan}
    monkeypatch.setattr(_autotune, "_make_plan", lambda problem, s, tune: made[s.x_layout])
    assert _autotune._choose(problem, True, False, False, True, None) is plan
    assert plan.candidates == {"nhwc": (1.0, 1.0)}
    made["nhwc"] = _autotune._SHORT_OF_MEMORY
    with pytest.raises(_autotune._ShortOfMemory):
        _autotune._choose(problem, True, False, False, True, None)
    made["nhwc"] = None
    with pytest.raises(_autotune._ShortOfMemory):
        _autotune._choose(problem, True, False, False, True, None)
    made["nchw"] = None
    with pytest.raises(_cudnn.UnsupportedConvolution):
        _autotune._choose(problem, True, False, False, True, None)


def test_clearing_the_plans_frees_the_graph_buffers_of_each_device_they_were_on(monkeypatch):
    # A CuPy pool frees the blocks of its current device only: the plans' graph buffers go
    # back to every device the pool allocated on, also where no plan is left to clear (a
    # plan that a caller's capture held until after the last clear).
    import contextlib

    from cufused._cudnn import _autotune, _plan

    current, freed = [0], []

    @contextlib.contextmanager
    def device(d):
        previous, current[0] = current[0], d
        try:
            yield
        finally:
            current[0] = previous

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=device))
    pool = types.SimpleNamespace(free_all_blocks=lambda: freed.append(current[0]))
    monkeypatch.setattr(_plan, "import_cupy", lambda: fake_cupy)
    monkeypatch.setattr(_plan, "_graph_buffer_pool", lambda: pool)
    monkeypatch.setattr(_plan, "_graph_buffer_devices", {3, 1})
    monkeypatch.setattr(_autotune, "release_after_devices",
                        lambda devices, held: held.clear())
    for plans in ({(1, "problem"): object()}, {}):
        freed.clear()
        monkeypatch.setattr(_autotune, "_plans", plans)
        _autotune.clear_plan_cache()
        assert freed == [1, 3] and current == [0]
        assert not _autotune._plans
