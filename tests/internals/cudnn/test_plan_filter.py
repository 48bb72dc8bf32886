"""Which of a cuDNN graph's plans the plan search may run (CPU: a stand-in plan list)."""

from __future__ import annotations

import types


class _PlanList:
    """A stand-in for a built cuDNN graph's ranked plans: their names (None: unnamed)."""

    def __init__(self, names):
        self.names = names

    def get_execution_plan_count(self):
        return len(self.names)

    def get_plan_name_at_index(self, index):
        if self.names[index] is None:
            raise RuntimeError("no name")
        return self.names[index]


def test_plans_of_engines_that_fault_never_run():
    # A graph with the bias inside it never runs its engine 52 (any knobs); other engines,
    # unnamed plans and the convolution alone keep every plan, in cuDNN's order.
    from cufused._cudnn._graphs import runnable_plans

    graph = _PlanList(["eng0", "eng52", "eng52_k2=4_k18=0", "eng520", "eng11_k2=4", None])
    with_bias = types.SimpleNamespace(bias_strides=(12, 1, 1, 1))
    assert runnable_plans(with_bias, graph) == [0, 3, 4, 5]
    assert runnable_plans(types.SimpleNamespace(bias_strides=None), graph) == list(range(6))
