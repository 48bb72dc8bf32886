"""A pipeline's device time with its convolution plan replayed from a CUDA graph against
issued directly (device).

The autotuner decides replay or direct calls from the convolution alone (``_decide_replay``);
this checks the choice inside each canonical pipeline, whose argument checks come before the
convolution and use up part of the head start that hides a direct call's host work: median
ms, CUDA events, L2 flushed, the two ways alternating round by round in one process.
Usage: python scripts/pipeline_conv_replay.py [CASE ...] (default: B)
"""

import sys

from cufused.benchmark import Timer, conv_plan_for
from pipeline_calls import pipeline_calls  # scripts/, the script's own folder


def with_replays(plan, replays, call):
    """``call`` with ``plan``'s graphs set to ``replays`` (None: direct calls)."""
    def run():
        plan._replays = replays
        call()
    return run


def main(names):
    for case, precision, call in pipeline_calls(names):
        call()
        plan = conv_plan_for(case, precision)
        chosen = "direct" if plan._replays is None else "replayed"
        graphs = {} if plan._replays is None else plan._replays
        times = Timer(repeat=40).compare({
            "replayed": with_replays(plan, graphs, call),
            "direct": with_replays(plan, None, call)})
        plan._replays = graphs
        print(f"{case.name} {precision} ({plan.strategy.label}, autotuner: {chosen}): "
              f"pipeline ms replayed {times['replayed']:.3f}, direct {times['direct']:.3f}",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["B"])
