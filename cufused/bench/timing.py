"""GPU timing for ``python -m cufused bench``, the asv suite and the scripts.

Timing follows KernelBench / Tensara: CUDA events around one call on the current stream,
after warm-up, with the L2 cache flushed (a 256 MiB write) before each timed run; the median
is reported. PyTorch eager and ``torch.compile`` run the same math in the same process.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import numpy

import cufused

from .cases import Case, on_gpu, rel_err, torch_pipeline

L2_FLUSH_BYTES = 256 * 1024 * 1024


def host_us_per_call(call: Callable[[], Any], *, calls: int = 20, repeat: int = 5) -> float:
    """Median host microseconds of a warm ``call()`` issued back to back without
    synchronizing (the device work queues up behind it): ``repeat`` runs of ``calls`` calls,
    the device idle before each run."""
    import cupy

    samples = []
    for _ in range(repeat):
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    cupy.cuda.Device().synchronize()
    return float(numpy.median(samples))


class Timer:
    """CUDA-event timing with an L2 flush before each run (median of ``repeat`` runs)."""

    def __init__(self, repeat: int = 20, warmup: int = 3):
        import cupy

        self.repeat, self.warmup = repeat, warmup
        self._flush = cupy.empty(L2_FLUSH_BYTES // 4, dtype=cupy.float32)

    def __call__(self, fn: Callable[[], Any]) -> float:
        return self.compare({"fn": fn})["fn"]

    def compare(self, fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
        """Median ms of each of ``fns`` (see ``samples``)."""
        return {name: float(numpy.median(t)) for name, t in self.samples(fns).items()}

    def samples(self, fns: dict[str, Callable[[], Any]]) -> dict[str, numpy.ndarray]:
        """Each round's ms of each of ``fns``: all warmed up first, then timed in ``repeat``
        rounds of one call each, the order reversed every other round, so that clock or
        memory-state drift during the run, and the call before, weigh on all alike."""
        import cupy

        for fn in fns.values():
            for _ in range(self.warmup):
                fn()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        times = {name: [] for name in fns}
        names = list(fns)
        for r in range(self.repeat):
            for name in names if r % 2 == 0 else names[::-1]:
                self._flush.fill(1.0)
                start.record()
                fns[name]()
                stop.record()
                stop.synchronize()
                times[name].append(cupy.cuda.get_elapsed_time(start, stop))
        return {name: numpy.array(t) for name, t in times.items()}


def measure_ceilings(timer: Timer) -> dict:
    """Device-to-device copy bandwidth and float32 / TF32 matrix rates, measured."""
    import cupy

    a = cupy.empty(256 * 1024 * 1024, dtype=cupy.float32)  # 1 GiB
    b = cupy.empty_like(a)
    a.fill(1.0)
    ms = timer(lambda: b.__setitem__(Ellipsis, a))
    result = {"copy_TBps": 2 * a.nbytes / (ms * 1e-3) / 1e12}
    a = b = None  # free the 2 GiB before the matrix products
    m = cupy.random.default_rng(0).random((8192, 8192), dtype=cupy.float32)
    ms = timer(lambda: m @ m)
    result["fp32_TFLOPs"] = 2 * 8192**3 / (ms * 1e-3) / 1e12
    torch = torch_on_cuda()
    if torch is not None:
        t = torch.rand(8192, 8192, device="cuda")
        allowed = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            ms = timer(lambda: t @ t)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = allowed
        result["tf32_TFLOPs"] = 2 * 8192**3 / (ms * 1e-3) / 1e12
    return result


def torch_on_cuda():
    """PyTorch where it is installed and sees a CUDA device, else None (a CPU build, or one
    whose driver is too old: the benchmark then runs without PyTorch's rows)."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def set_torch_precision(precision: str) -> None:
    import torch

    tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32


def _conv_options(case: Case) -> dict:
    """The options of a case's convolution (those among stride, padding, output_padding)."""
    return {k: case.options[k] for k in ("stride", "padding", "output_padding")
            if k in case.options}


def conv_plan_for(case: Case, precision: str, *, layout_free: bool = False):
    """The cached cuDNN plan that the fused pipeline uses for this case's convolution, or with
    ``layout_free`` the one chosen for an input that may come in any layout (the setting of
    the best-plan table in the design: no input conversion counted)."""
    from .._cudnn import ConvProblem, conv_plan
    from .._ops._conv_args import check_conv_args

    c = case.conv
    args = check_conv_args(c["x_shape"], c["w_shape"], len(c["x_shape"]) - 2,
                           transposed=c["kind"] == "dgrad", **{"stride": 1, "padding": 0,
                                                               **_conv_options(case)})
    # cuDNN has no 3xTF32: the pipeline's cuDNN convolutions then run in exact float32.
    problem = ConvProblem(c["kind"], tuple(c["x_shape"]), tuple(c["w_shape"]), args.out_shape,
                          args.stride, args.padding, args.dilation,
                          "ieee" if precision == "3xtf32" else precision)
    return conv_plan(problem, convert_input=case.name != "C" and not layout_free,
                     convert_output=False, accept_classes=case.name == "C")


def public_conv(case: Case):
    """The public cufused convolution of a case and its options."""
    c = case.conv
    nd = len(c["x_shape"]) - 2
    name = ("conv" if c["kind"] == "fprop" else "conv_transpose") + f"{nd}d"
    return getattr(cufused, name), _conv_options(case)


def _torch_calls(case: Case, gpu: dict, *, compiled: bool) -> dict:
    """PyTorch's pipeline, eager and (where asked) compiled, as calls on tensors that share
    the case's CuPy inputs; none without PyTorch."""
    calls = {}
    torch = torch_on_cuda()
    if torch is not None:
        targs = [torch.as_tensor(v, device="cuda") for v in gpu.values()]
        fn = torch_pipeline(case)
        calls["torch_eager"] = fn
        if compiled:
            calls["torch_compile"] = torch.compile(fn)
            calls["torch_compile_ro"] = torch.compile(fn, mode="reduce-overhead")
    return {k: (lambda f=f: f(*targs)) for k, f in calls.items()}


def _timed_calls(case: Case, precision: str, inputs: dict, out, rng, torch_calls: dict):
    """The calls that ``bench_case`` times at one precision, in their order, and the plans of
    the pipeline's convolution and of the layout-free one."""
    import cupy

    from .._layout import empty_in_layout

    gpu = on_gpu(inputs)
    plan = conv_plan_for(case, precision)
    operands = plan.example_operands()
    free_plan = conv_plan_for(case, precision, layout_free=True)
    free_operands = free_plan.example_operands() if free_plan is not plan else None
    # The public convolution (NCHW in and out, conversions included) on the conv input,
    # without and with a per-channel bias (PyTorch adds a bias in a pass of its own).
    conv_fn, conv_opts = public_conv(case)
    xc = cupy.asarray(rng.random(case.conv["x_shape"], dtype=numpy.float32))
    wc = gpu["weight"]
    bc = cupy.asarray(rng.uniform(-0.1, 0.1, case.conv["y_shape"][1]).astype(numpy.float32))
    prepared = cufused.prepare(getattr(cufused, case.pipeline), *gpu.values(), **case.options,
                               precision=precision, out=out)
    fns = {
        "fused": lambda: case.run_cufused(inputs, precision=precision, out=out),
        "prepared": prepared,
        "unfused": lambda: case.run_cufused(inputs, precision=precision, method="unfused",
                                            out=out),
        "conv": lambda: plan.run(*operands),
        "conv_public": lambda: conv_fn(xc, wc, **conv_opts, precision=precision),
        "conv_public_bias": lambda: conv_fn(xc, wc, bc, **conv_opts, precision=precision),
    }
    if free_plan is not plan:  # else (C) the pipeline already runs the layout-free plan
        fns["conv_free"] = lambda: free_plan.run(*free_operands)
    # The public convolution into a channels-last out (NHWC / NDHWC memory), NCHW / NCDHW
    # input: the implicit GEMM writes such outputs itself.
    y_last = empty_in_layout(tuple(case.conv["y_shape"]), "nhwc")
    fns["conv_public_cl"] = lambda: conv_fn(xc, wc, **conv_opts, precision=precision,
                                            out=y_last)
    # The same from a channels-last input, as PyTorch's channels_last calls below get theirs.
    x_last = empty_in_layout(tuple(case.conv["x_shape"]), "nhwc")
    x_last[...] = xc
    fns["conv_public_cl_in"] = lambda: conv_fn(x_last, wc, **conv_opts, precision=precision,
                                               out=y_last)
    if torch_calls:
        import torch

        fns.update(torch_calls)
        torch_conv = getattr(torch.nn.functional, conv_fn.__name__)
        xt, wt, bt = (torch.as_tensor(a, device="cuda") for a in (xc, wc, bc))
        fns["torch_conv"] = lambda: torch_conv(xt, wt, **conv_opts)
        fns["torch_conv_bias"] = lambda: torch_conv(xt, wt, bt, **conv_opts)
        # PyTorch's channels_last (channels_last_3d) input and weight: a channels-last out.
        last = torch.channels_last if xt.ndim == 4 else torch.channels_last_3d
        xl, wl = (t.to(memory_format=last) for t in (xt, wt))
        fns["torch_conv_cl"] = lambda: torch_conv(xl, wl, **conv_opts)
    return fns, plan, free_plan


#: The timed calls whose results ``bench_case`` checks (``err_<name>`` in its rows).
RESULT_CALLS = ("fused", "prepared", "unfused")


def _result_errors(fns: dict, out, reference) -> dict:
    """``err_<name>``: the relative error (:func:`~.cases.rel_err`) against the float64
    ``reference`` of each of :data:`RESULT_CALLS`' results, ``out`` NaN-poisoned before each
    call (each of them writes it; an element left unwritten counts as NaN)."""
    errors = {}
    for name in RESULT_CALLS:
        out.fill(numpy.nan)
        errors[f"err_{name}"] = rel_err(fns[name](), reference)
    return errors


@contextlib.contextmanager
def _pytorch_at(precision: str, active: bool):
    """Where ``active``: PyTorch set to ``precision`` and without autograd for the block (its
    TF32 switches restored after it)."""
    if not active:
        yield
        return
    import torch

    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    set_torch_precision(precision)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _compare(timer: Timer, fns: dict, precision: str, *, torch_calls: bool) -> dict:
    """``timer.compare(fns)``; with PyTorch calls among them, PyTorch set to ``precision``
    and without autograd for the run."""
    with _pytorch_at(precision, torch_calls):
        return timer.compare(fns)


def _host_times(fns: dict, precision: str, fused_new: Callable[[], Any]) -> dict:
    """Host microseconds per warm call (:func:`host_us_per_call`) of the fused, prepared and
    PyTorch calls among ``fns``, as ``host_us_<name>``, and of ``fused_new`` (the fused call
    without ``out``, warmed up first) as ``host_us_fused_new``."""
    for _ in range(3):
        fused_new()
    row = {"host_us_fused_new": host_us_per_call(fused_new)}
    for name in ("fused", "prepared", "torch_eager", "torch_compile", "torch_compile_ro"):
        if name in fns:
            with _pytorch_at(precision, name.startswith("torch")):
                row[f"host_us_{name}"] = host_us_per_call(fns[name])
    return row


def bench_case(case: Case, timer: Timer, *, precisions=("ieee", "tf32"),
               torch_compile=True) -> list[dict]:
    """Time one case: fused, prepared, unfused, the internal convolution (the pipeline's
    plan, and the plan for an input in any layout), the public convolution, PyTorch eager
    and compiled (default and "reduce-overhead"); the host microseconds per call of the
    fused (with and without ``out``), prepared and PyTorch calls, and the fused call's
    back-to-back device time."""
    import cupy

    rng = numpy.random.default_rng(0)
    inputs = case.make_inputs(rng)
    gpu = on_gpu(inputs)
    reference = case.reference(gpu)  # float64, on the GPU
    out = cupy.empty(case.output_shape, dtype=cupy.float32)
    torch_calls = _torch_calls(case, gpu, compiled=torch_compile)
    rows = []
    for precision in precisions:
        fns, plan, free_plan = _timed_calls(case, precision, inputs, out, rng, torch_calls)
        row = _compare(timer, fns, precision, torch_calls=bool(torch_calls))
        row.update(_result_errors(fns, out, reference))
        row.update(_host_times(fns, precision, lambda: case.run_cufused(
            inputs, precision=precision)))
        # Device ms per call of 20 fused calls back to back (CUDA events around them).
        from .._timing import time_ms

        row["fused_back_to_back"] = time_ms(fns["fused"], repeat=5, batch=20)
        row.setdefault("conv_free", row["conv"])
        row.update(case=case.name, precision=precision, conv_layout=plan.strategy.label,
                   conv_calls="replayed" if plan.replays else "direct",
                   conv_free_layout=free_plan.strategy.label,
                   conv_engine=conv_engine(case, gpu, precision))
        rows.append(row)
        del fns  # this precision's operands go before the next precision's are made
    return rows


def conv_engine(case: Case, gpu: dict, precision: str) -> str:
    """How the fused pipeline's convolution runs, as its first call settled it: "epilogue"
    (on cufused's implicit GEMM with the pass in its epilogue: pipeline A's extrema and
    statistics, pipeline C's softmax sums and the convolution computed again for the result),
    "igemm" (on the implicit GEMM, the pass after it), "fft" (pipeline B's convolution through
    DFTs, the pass after it) or "cudnn". The ``conv`` figure is the cuDNN plan's, which only
    "cudnn" runs."""
    import cupy

    from .._ops._conv_args import cached_conv_args
    from .._ops.convolution import own_engine
    from ..pipelines import pipeline_a, pipeline_c

    x, w, o = gpu["x"], gpu["weight"], case.options
    if case.name == "C":
        k = o["pool_kernel"]
        pooled = x.shape[:2] + tuple(s // k for s in x.shape[2:])
        args = cached_conv_args(pooled, w.shape, 3, transposed=True, stride=o["stride"],
                                padding=o["padding"], output_padding=o["output_padding"])
        recompute = pipeline_c._recompute_applies(cupy, x, w, args, precision, k, pooled,
                                                  "conv_bias" in gpu, o["clamp_min"],
                                                  o["clamp_max"])
        return "epilogue" if recompute else "cudnn"  # else: a cuDNN plan (gpu_conv_plan)
    transposed = case.name == "B"
    args = cached_conv_args(x.shape, w.shape, 2, transposed=transposed,
                            stride=o.get("stride", 1), padding=o.get("padding", 0))
    if case.name == "A" and pipeline_a._epilogue_applies(
            cupy, x, w, args, precision, o["pool_kernel"], o["num_groups"], "conv_bias" in gpu):
        return "epilogue"
    # Pipelines A (without the epilogue) and B: conv_on_gpu without bias or out, B's with
    # batch statistics.
    engine = own_engine(x, w, args, precision, batch_statistics=transposed)
    return "cudnn" if engine is None else engine[0]


def add_floors(case: Case, rows: list[dict], ceilings: dict) -> None:
    """Add to each of a case's rows its floors in ms: ``floor``, the direct convolution's
    FLOPs at the measured matrix rate of its precision or the pipeline's input and output at
    the copy bandwidth, whichever takes longer (None for a tensor-core precision without a
    measured TF32 rate); ``post_floor``, what the pipeline moves besides the convolution.

    ``floor`` bounds a direct (GEMM-like) convolution: an FFT or Winograd plan does fewer
    multiplications and may beat it, as cuDNN's do for pipeline B in exact float32."""
    bandwidth = ceilings["copy_TBps"] * 1e12
    tensor = ceilings.get("tf32_TFLOPs")
    for r in rows:
        # 3xTF32 issues three TF32 products per multiply-add.
        tflops = (ceilings["fp32_TFLOPs"] if r["precision"] == "ieee" else None
                  if tensor is None else tensor / 3 if r["precision"] == "3xtf32" else tensor)
        byte_ms = case.io_bytes() / bandwidth * 1e3
        r["floor"] = (None if tflops is None
                      else max(case.conv_flops() / (tflops * 1e12) * 1e3, byte_ms))
        r["post_floor"] = case.post_conv_bytes() / bandwidth * 1e3
