"""cuDNN convolutions through cuDNN Frontend's Python API.

A forward convolution is ``conv_fprop``; a transposed convolution is ``conv_dgrad`` with the
ConvTranspose weight unchanged and the output shape set explicitly, or (the "subpixel"
method, :mod:`cufused._subpixel`) one ``conv_fprop`` per output residue class with a
rearranged weight. Each distinct problem (device, kind, shapes, parameters, precision, bias)
gets a :class:`ConvPlan`, built once: on first use every candidate :class:`Strategy` (method,
input layout, output layout, bias inside the graph or not) has its cuDNN plans timed with
CUDA events, like ``torch.backends.cudnn.benchmark``, and the fastest strategy, timed with the
layout conversions its caller would pay, is kept. The plan exposes its layouts so that the
fused kernels downstream read a channels-last or class-major output directly.

The modules, each importing only those above it:

- ``_config``: the import of cuDNN Frontend and the pool of cuDNN handles (one borrowed per
  call).
- ``_graphs``: ``ConvProblem``, ``Strategy`` and ``strategies``; each strategy's graphs
  (the sub-pixel split), their building, and the execution of a graph's chosen plan.
- ``_plan``: ``ConvPlan``, which feeds its graphs in its layouts and replays warm calls as
  CUDA graphs.
- ``_autotune``: the entry point ``conv_plan`` (the plan for the convolution of this call, in
  the layouts its caller passes and reads), the choice of strategy and of replay, and the
  plan cache (``clear_plan_cache``).

The layout conversions a plan runs are launchers (:mod:`cufused._kernels.layout`); the
timing of candidates (CUDA events, random operands, the L2 flush) is :mod:`cufused._timing`.
The settings that choose and run plans are :mod:`cufused._settings`'s. Settings and caches
are shared objects (``_settings._config``, ``_plans``); a test that replaces a function or a
constant replaces it in the module that looks it up.
"""

from ._autotune import (_INPUT_CONVERSION_MARGIN, UnsupportedConvolution, _choose,
                        _decide_replay, _plans, clear_plan_cache, conv_plan, on_clear_plan_cache,
                        strategy_score)
from ._config import import_cudnn
from ._graphs import ConvProblem, Strategy, _part_specs, strategies
from ._plan import ConvPlan, _graph_buffer_pool, plans_in_use

__all__ = [
    "conv_plan", "ConvPlan", "ConvProblem", "Strategy", "strategies", "strategy_score",
    "UnsupportedConvolution", "clear_plan_cache", "import_cudnn", "plans_in_use",
    "on_clear_plan_cache",
    # private names that tests and scripts reach through the package
    "_plans", "_choose", "_decide_replay", "_graph_buffer_pool", "_part_specs",
    "_INPUT_CONVERSION_MARGIN",
]
