"""Shared by the pipeline timing scripts: the canonical pipeline calls, and the time of one
call replayed from a CUDA graph of the whole call (what is left without host overhead)."""

import cupy
import numpy

from cufused.bench.cases import CASES


def pipeline_calls(names):
    """``(case, precision, call)`` for the canonical cases in ``names``, both precisions;
    ``call()`` runs the fused pipeline on fixed inputs into a buffer of its own."""
    for case in CASES:
        if case.name not in names:
            continue
        inputs = case.make_inputs(numpy.random.default_rng(0))
        out = cupy.empty(case.output_shape, dtype=cupy.float32)
        for precision in ("ieee", "tf32"):
            yield case, precision, (lambda c=case, i=inputs, p=precision, o=out:
                                    c.run_cufused(i, precision=p, out=o))


def graph_replay_ms(timer, call) -> float:
    """``timer``'s time of ``call`` captured whole into one CUDA graph and replayed."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        call()
        stream.begin_capture()
        call()
        graph = stream.end_capture()
    return timer(lambda: graph.launch(stream=cupy.cuda.get_current_stream()))
