"""The process settings of cufused's convolutions and warm calls: plan autotuning, pinned
strategies (tests), CUDA-graph replay and a forced convolution engine, with their setters
and the scoped override :func:`plan_options`. Every layer that chooses or runs a convolution
reads them: the convolution ops (the engine), the cuDNN plans (autotuning, pins, replay) and
the whole-call graphs (replay, and the settings in each key)."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy

# Plan-choice settings: autotuning on/off, strategy labels to pin (tests), None for all, graph
# replay, and the convolution engine forced where an engine of cufused's takes a problem
# ("igemm", "fft" or "cudnn"; None: the one measured fastest).
_config: dict[str, Any] = {"autotune": True, "pins": None, "replay": True, "engine": None}


def set_conv_autotune(enabled: bool) -> None:
    """Switch plan autotuning on (default) or off.

    With autotuning, the first call for a convolution problem times every cuDNN plan of every
    strategy (layouts, method) and keeps the fastest; without it, the first plan of cuDNN's
    heuristics for a plain NCHW convolution is used. Plans already chosen are kept.

    Parameters
    ----------
    enabled : bool
        Whether new problems are autotuned.

    Raises
    ------
    TypeError
        ``enabled`` is not a bool (NumPy's ``bool_`` is one).

    Examples
    --------
    >>> import cufused
    >>> cufused.set_conv_autotune(False)
    >>> cufused.set_conv_autotune(True)
    """
    _config["autotune"] = _check_switch(enabled)


def set_conv_graph_replay(enabled: bool) -> None:
    """Switch the CUDA-graph replay of warm convolution and pipeline calls on (default) or
    off.

    A warm pipeline call replays one CUDA graph of the whole call (keyed on every operand's
    address, shape, strides and dtype, every option and the stream; at most 8 such graphs,
    see :func:`clear_caches`).

    From the second call with the same operand pointers on a stream, a convolution replays one
    CUDA graph of its cuDNN calls, weight preparation and output conversion instead of issuing
    each again, which takes a few tens of microseconds of host time per call where issuing
    the parts takes up to a few hundred (FFT and sub-pixel plans). Each graph keeps its own
    workspace, prepared weight and, where the plan writes another layout than the NCHW
    result, its intermediate output (up to 8 graphs per plan, and the graphs of all plans
    within 1/8 of the device's memory, the oldest dropped first; a call whose buffers alone
    would pass that runs directly; :func:`clear_plan_cache` frees them). A call made while the
    stream is being captured always runs directly, and so does a
    plan whose direct calls the autotuner measured faster on the device by more than the host
    time they add.

    Parameters
    ----------
    enabled : bool
        Whether warm calls replay graphs. Graphs captured before replay was switched off are
        kept, unused, until :func:`clear_plan_cache`.

    Raises
    ------
    TypeError
        ``enabled`` is not a bool: a string such as ``"no"`` is refused, not read as on.

    Examples
    --------
    >>> import cufused
    >>> cufused.set_conv_graph_replay(False)
    >>> cufused.clear_plan_cache()  # frees the graphs captured so far
    >>> cufused.set_conv_graph_replay(True)
    """
    _config["replay"] = _check_switch(enabled)


def _check_switch(enabled: Any) -> bool:
    """A setting's switch is a bool (NumPy's too): a string such as "no" is not read as on."""
    if not isinstance(enabled, (bool, numpy.bool_)):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    return bool(enabled)


@contextlib.contextmanager
def plan_options(*, autotune: bool | None = None, pins: tuple[str, ...] | None = None,
                 replay: bool | None = None, engine: str | None = None):
    """Temporarily change how new plans are chosen, and how plans run.

    ``pins`` restricts the strategies to those whose :attr:`Strategy.label` is listed (tests
    pin each one in turn); a problem that has none of them falls back to the direct method in
    the pinned layouts. ``replay=False`` runs every call through cuDNN directly instead of
    replaying the CUDA graph captured for repeated operands (see :meth:`ConvPlan.run`).
    ``engine`` forces the engine of the convolutions that an engine of cufused's computes:
    "igemm" (the implicit GEMM: TF32 and 3xTF32), "fft" (pipeline B's convolution through
    DFTs: "ieee" and 3xTF32) or "cudnn" (tests and benchmarks; a problem that the forced
    engine does not take runs on cuDNN), or "auto": the fastest one measured (the default).
    Every option left as None keeps its current setting; on exit the options given get back
    the settings they had on entry, and the others keep any change made meanwhile.
    """
    if engine not in (None, "auto", "igemm", "fft", "cudnn"):
        raise ValueError(
            f"engine must be 'auto', 'igemm', 'fft', 'cudnn' or None, not {engine!r}")
    changed: dict[str, Any] = {}
    if autotune is not None:
        changed["autotune"] = autotune
    if pins is not None:
        changed["pins"] = tuple(pins)
    if replay is not None:
        changed["replay"] = replay
    if engine is not None:
        changed["engine"] = None if engine == "auto" else engine
    # Only the settings given here are restored: changes made meanwhile to the others (by
    # another thread's set_conv_autotune, say) stand.
    saved = {key: _config[key] for key in changed}
    _config.update(changed)
    try:
        yield
    finally:
        _config.update(saved)
