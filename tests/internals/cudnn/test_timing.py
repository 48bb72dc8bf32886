"""The autotuner's timing (CPU side, a stand-in for CuPy's events): how many runs a call
gets, by its first run's time and the best time so far."""

from __future__ import annotations

import types

import pytest

from cufused import _timing
from cufused._cudnn import _autotune


def _clock(monkeypatch, run_ms: float) -> tuple:
    """CuPy's events replaced by a clock that each call of the timed function advances by
    ``run_ms``; returns the list of the calls' runs and the function."""
    now, runs = [0.0], []

    class Event:
        def record(self):
            self.at = now[0]

        def synchronize(self):
            pass

    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Event=Event, get_elapsed_time=lambda a, b: b.at - a.at))
    monkeypatch.setattr(_timing, "import_cupy", lambda: cupy)

    def call():
        now[0] += run_ms
        runs.append(1)
    return runs, call


@pytest.mark.parametrize("run_ms, give_up_ms, runs", [
    (0.5, None, 1 + 5 * 3),    # a short call: a warm-up, then 5 samples of 3 runs
    (25.0, None, 1 + 3),       # a long one: a warm-up and 3 single runs
    (25.0, 100.0, 1 + 3),      # faster than the give-up time: timed in full
    (90.0, 60.0, 1),           # slower: its warm-up run is its time
])
def test_runs_per_timing(monkeypatch, run_ms, give_up_ms, runs):
    done, call = _clock(monkeypatch, run_ms)
    assert _timing.time_ms(call, give_up_ms=give_up_ms) == pytest.approx(run_ms)
    assert len(done) == runs


def test_plans_give_up_only_beside_a_long_best():
    plan = types.SimpleNamespace
    assert _autotune._give_up_ms(None) is None
    assert _autotune._give_up_ms(plan(milliseconds=0.6)) is None  # first runs load kernels
    assert _autotune._give_up_ms(plan(milliseconds=_timing.LONG_CALL_MS)) == pytest.approx(
        3 * _timing.LONG_CALL_MS)


def test_plans_of_a_graph_are_cut_only_beside_a_long_best():
    plan = types.SimpleNamespace
    limit = _autotune._LONG_CALL_PLANS
    assert not _autotune._enough_plans(None, 10 * limit)
    assert not _autotune._enough_plans(plan(milliseconds=0.6), 10 * limit)  # all are timed
    long = plan(milliseconds=_timing.LONG_CALL_MS)
    assert not _autotune._enough_plans(long, limit - 1)
    assert _autotune._enough_plans(long, limit)
