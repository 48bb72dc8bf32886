"""cuDNN experiments behind the convolution design choices (run on the device machine).

1. host time of a warm convolution call, split into its parts;
2. bias inside the cuDNN graph vs a separate epilogue;
3. a stride-1 transposed convolution as a forward convolution with flipped weights;
4. a stride-2 transposed 3-D convolution as 8 forward sub-convolutions (sub-pixel split);
5. pipeline B's convolution in two batch halves, the first half's fused pass on a second
   stream beside the second half's convolution (can the pass hide behind the convolution?);
6. every engine and knob setting cuDNN offers (not only the heuristics' list) for the
   canonical convolutions;
7. B's float32-exact convolution posed other ways (crop of the full convolution, batch or
   channel chunks, a forward convolution of a zero-padded input).
Prints one line per measurement (device ms are medians of CUDA events, L2 not flushed).
"""

import cProfile
import itertools
import pstats
import sys
import time

import cupy
import numpy

import cufused
from cufused import _cudnn
from cufused.convolution import check_conv_args, conv_on_gpu


def host_us(fn, n=30):
    fn()
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    cupy.cuda.Device().synchronize()
    return t


CONVS = {  # name: (transposed, x shape, w shape, kwargs)
    "A": (False, (128, 8, 128, 128), (64, 8, 3, 3), {}),
    "B": (True, (512, 64, 32, 32), (64, 128, 5, 5), {"padding": 1}),
    "C": (True, (32, 32, 16, 32, 32), (32, 64, 3, 3, 3),
          {"stride": 2, "padding": 1, "output_padding": 1}),
    "Bsmall": (True, (4, 64, 8, 8), (64, 128, 5, 5), {"padding": 1}),
}


def host_breakdown():
    rng = cupy.random.default_rng(0)
    for name, (transposed, xs, ws, kw) in CONVS.items():
        for precision in ("ieee", "tf32"):
            x = rng.random(xs, dtype=cupy.float32)
            w = rng.random(ws, dtype=cupy.float32)
            nd = len(xs) - 2
            fn = {(False, 2): cufused.conv2d, (True, 2): cufused.conv_transpose2d,
                  (True, 3): cufused.conv_transpose3d}[(transposed, nd)]
            public = lambda: fn(x, w, precision=precision, **kw)  # noqa: E731
            public()
            args = check_conv_args(xs, ws, nd, transposed=transposed,
                                   stride=kw.get("stride", 1), padding=kw.get("padding", 0),
                                   output_padding=kw.get("output_padding", 0))
            problem = _cudnn.ConvProblem("dgrad" if transposed else "fprop", xs, ws,
                                         args.out_shape, args.stride, args.padding,
                                         args.dilation, precision)
            plan = _cudnn.conv_plan(problem, convert_input=True, convert_output=True)
            xl = _cudnn.empty_in_layout(xs, plan.x_layout)
            xl[...] = x
            y = plan.empty_output()
            part = plan.parts[0]
            ws_buf = cupy.empty(max(plan.workspace_size, 1), dtype=cupy.uint8)
            handle = _cudnn._handle()
            parts = {
                "public": public,
                "conv_on_gpu": lambda: conv_on_gpu(x, w, args, precision),
                "plan.apply": lambda: plan.apply(x, w),
                "plan.run": lambda: plan.run(xl, w, y),
                "part.execute": lambda: part.execute(xl.data.ptr, w.data.ptr, y.data.ptr, 0,
                                                     ws_buf.data.ptr, handle),
                "_handle": _cudnn._handle,
                "ws empty": lambda: cupy.empty(plan.workspace_size, dtype=cupy.uint8),
                "problem+plan lookup": lambda: _cudnn.conv_plan(
                    _cudnn.ConvProblem("dgrad" if transposed else "fprop", xs, ws,
                                       args.out_shape, args.stride, args.padding,
                                       args.dilation, precision),
                    convert_input=True, convert_output=True),
                "check_conv_args": lambda: check_conv_args(
                    xs, ws, nd, transposed=transposed, stride=kw.get("stride", 1),
                    padding=kw.get("padding", 0), output_padding=kw.get("output_padding", 0)),
            }
            line = " ".join(f"{k}={host_us(f):.1f}" for k, f in parts.items())
            print(f"host_us {name} {precision} strategy={plan.strategy.label} "
                  f"ws={plan.workspace_size} {line}", flush=True)
    x = rng.random(CONVS["Bsmall"][1], dtype=cupy.float32)
    w = rng.random(CONVS["Bsmall"][2], dtype=cupy.float32)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        cufused.conv_transpose2d(x, w, padding=1)
    prof.disable()
    cupy.cuda.Device().synchronize()
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(14)


def build(kind, xs, ws, ys, pre, post, stride, layout, precision, bias=False, y_strides=None):
    """The library's graph builder with every plan built; ``layout`` is one layout for all
    tensors or an (x, w, y) tuple of layouts."""
    cudnn = _cudnn.import_cudnn()
    lx, lw, ly = (layout,) * 3 if isinstance(layout, str) else layout
    nd = len(xs) - 2
    spec = _cudnn._PartSpec(
        kind, tuple(xs), _cudnn.layout_strides(xs, lx), tuple(ws), _cudnn.layout_strides(ws, lw),
        tuple(ys), tuple(y_strides or _cudnn.layout_strides(ys, ly)), tuple(pre), tuple(post),
        tuple(stride), (1,) * nd,
        _cudnn.layout_strides((1, ys[1]) + (1,) * nd, ly) if bias else None)
    g, tensors = _cudnn._build_graph(spec, precision)
    g.build_plans(cudnn.build_plan_policy.ALL)
    return g, tensors


def best_plan_ms(kind, xs, ws, ys, pre, post, stride, layout, precision, bias=False,
                 y_strides=None):
    """(best ms, "N plans, fastest NAME") over every plan that builds, or (nan, reason)."""
    try:
        g, tensors = build(kind, xs, ws, ys, pre, post, stride, layout, precision, bias,
                           y_strides)
    except Exception as exc:  # noqa: BLE001
        return float("nan"), f"build failed: {str(exc)[:80]}"
    rng = cupy.random.default_rng(1)
    arrays = []
    layouts = (layout,) * 4 if isinstance(layout, str) else (*layout, layout[-1])
    for t, lt in zip(tensors, layouts[:2] + layouts[-len(tensors) + 2:]):
        a = _cudnn.empty_in_layout(tuple(t.get_dim()), lt)
        if y_strides is not None and t is tensors[-1]:  # a strided view of a 2**nd larger array
            nd = len(xs) - 2
            big = _cudnn.empty_in_layout((ys[0], ys[1], *(2 * e for e in ys[2:])), lt)
            a = big[(slice(None), slice(None)) + (slice(None, None, 2),) * nd]
        a[...] = rng.random(a.shape, dtype=cupy.float32)
        arrays.append(a)
    handle = _cudnn._handle()
    best, count, name = float("nan"), 0, ""
    for i in range(g.get_execution_plan_count()):
        try:
            size = g.get_workspace_size_plan_at_index(i)
            ws_buf = cupy.empty(max(size, 1), dtype=cupy.uint8)
            pack = {t: a.data.ptr for t, a in zip(tensors, arrays)}
            run = lambda: g.execute_plan_at_index(pack, ws_buf.data.ptr, i,  # noqa: E731
                                                  handle=handle)
            ms = _cudnn._time_ms(run, repeat=3, batch=2)
        except Exception:  # noqa: BLE001
            continue
        count += 1
        if not best <= ms:
            best, name = ms, g.get_plan_name_at_index(i)
    return best, f"{count} plans, fastest {name}"


def bias_in_graph():
    for name, kind, xs, ws, ys, pad, stride in (
            ("A", "fprop", (128, 8, 128, 128), (64, 8, 3, 3), (128, 64, 126, 126), 0, 1),
            ("B", "dgrad", (512, 64, 32, 32), (64, 128, 5, 5), (512, 128, 34, 34), 1, 1),
            ("C", "dgrad", (32, 32, 16, 32, 32), (32, 64, 3, 3, 3), (32, 64, 32, 64, 64), 1, 2)):
        nd = len(xs) - 2
        for layout, precision in (("nchw", "ieee"), ("nhwc", "tf32"), ("nchw", "tf32")):
            res = {}
            for bias in (False, True):
                res[bias] = best_plan_ms(kind, xs, ws, ys, [pad] * nd, [pad] * nd,
                                         [stride] * nd, layout, precision, bias)
            y = _cudnn.empty_in_layout(ys, layout)
            b = cupy.ones((1, ys[1]) + (1,) * nd, dtype=cupy.float32)
            add_ms = _cudnn._time_ms(lambda: cupy.add(y, b, out=y), repeat=3, batch=2)
            print(f"bias {name} {layout} {precision}: plain {res[False]} in-graph {res[True]} "
                  f"separate add pass {add_ms:.3f} ms", flush=True)


def flipped_fprop_for_b():
    xs, ys = (512, 64, 32, 32), (512, 128, 34, 34)
    for layout, precision in itertools.product(("nchw", "nhwc"), ("ieee", "tf32")):
        dgrad = best_plan_ms("dgrad", xs, (64, 128, 5, 5), ys, [1, 1], [1, 1], [1, 1],
                             layout, precision)
        fprop = best_plan_ms("fprop", xs, (128, 64, 5, 5), ys, [3, 3], [3, 3], [1, 1],
                             layout, precision)
        print(f"B {layout} {precision}: dgrad {dgrad} fprop(flipped) {fprop}", flush=True)


def subpixel_for_c():
    xs = (32, 32, 16, 32, 32)
    for layout, precision in (("nchw", "ieee"), ("nhwc", "ieee"), ("nhwc", "tf32"),
                              ("nchw", "tf32")):
        total, parts = 0.0, []
        for taps in itertools.product((1, 2), repeat=3):
            ws = (64, 32, *taps)
            ys = (32, 64, 16, 32, 32)
            ms, count = best_plan_ms("fprop", xs, ws, ys, [0, 0, 0], [t - 1 for t in taps],
                                     [1, 1, 1], layout, precision)
            total += ms
            parts.append(f"{''.join(map(str, taps))}:{ms:.3f}/{count}")
        print(f"C subpixel {layout} {precision}: total {total:.3f} ms  {' '.join(parts)}",
              flush=True)


def subpixel_strided():
    """The sub-pixel split of C writing each class straight into the interleaved output."""
    xs, ys = (32, 32, 16, 32, 32), (32, 64, 16, 32, 32)
    for layout, precision in (("nchw", "ieee"), ("nhwc", "tf32")):
        full = _cudnn.layout_strides((32, 64, 32, 64, 64), layout)
        y_strides = [full[0], full[1], *(2 * e for e in full[2:])]
        total, parts = 0.0, []
        for taps in itertools.product((1, 2), repeat=3):
            ms, count = best_plan_ms("fprop", xs, (64, 32, *taps), ys, [0, 0, 0],
                                     [t - 1 for t in taps], [1, 1, 1], layout, precision,
                                     y_strides=y_strides)
            total += ms
            parts.append(f"{''.join(map(str, taps))}:{ms:.3f}/{count}")
        print(f"C subpixel strided {layout} {precision}: total {total:.3f} ms  "
              f"{' '.join(parts)}", flush=True)


def mixed_layouts():
    """Channels-last engines fed an NCHW input (no input transpose) or writing NCHW."""
    cases = (("A fprop", "fprop", (128, 8, 128, 128), (64, 8, 3, 3), (128, 64, 126, 126), 0),
             ("B fprop", "fprop", (512, 64, 32, 32), (128, 64, 5, 5), (512, 128, 34, 34), 3),
             ("B dgrad", "dgrad", (512, 64, 32, 32), (64, 128, 5, 5), (512, 128, 34, 34), 1))
    for name, kind, xs, ws, ys, pad in cases:
        for layout in (("nchw", "nhwc", "nhwc"), ("nhwc", "nhwc", "nchw"),
                       ("nchw", "nchw", "nhwc")):
            ms = best_plan_ms(kind, xs, ws, ys, [pad, pad], [pad, pad], [1, 1], layout, "tf32")
            print(f"mixed {name} x/w/y={'/'.join(layout)} tf32: {ms}", flush=True)
    # C: its pool writes the conv input in any layout for free; an NCDHW output would let the
    # one-read softmax run on it.
    for layout in (("nhwc", "nhwc", "nhwc"), ("nhwc", "nhwc", "nchw"), ("nchw", "nhwc", "nchw"),
                   ("nchw", "nchw", "nchw")):
        ms = best_plan_ms("dgrad", (32, 32, 16, 32, 32), (32, 64, 3, 3, 3), (32, 64, 32, 64, 64),
                          [1] * 3, [1] * 3, [2] * 3, layout, "tf32")
        print(f"mixed C dgrad x/w/y={'/'.join(layout)} tf32: {ms}", flush=True)


def b_formulations():
    """B's float32-exact convolution posed other ways that give the same output (or a
    superset to crop): the full 36 x 36 convolution, batch chunks, output-channel halves, the
    flipped forward convolution of a zero-padded input. Totals are chunk time x chunk count."""
    xs, ws = (512, 64, 32, 32), (64, 128, 5, 5)
    runs = [("dgrad pad 1 -> 34x34 (now)", 1, "dgrad", xs, ws, (512, 128, 34, 34), 1),
            ("dgrad pad 0 -> 36x36 (crop)", 1, "dgrad", xs, ws, (512, 128, 36, 36), 0),
            ("dgrad pad 2 -> 32x32 (interior only)", 1, "dgrad", xs, ws, (512, 128, 32, 32), 2),
            ("fprop valid on 40x40 zero-padded x", 1, "fprop", (512, 64, 40, 40),
             (128, 64, 5, 5), (512, 128, 36, 36), 0),
            ("fprop valid on 38x38 zero-padded x", 1, "fprop", (512, 64, 38, 38),
             (128, 64, 5, 5), (512, 128, 34, 34), 0),
            ("dgrad out-channel halves", 2, "dgrad", xs, (64, 64, 5, 5), (512, 64, 34, 34), 1)]
    for n in (256, 128, 64, 32):
        runs.append((f"dgrad batch chunks of {n}", 512 // n, "dgrad", (n, 64, 32, 32), ws,
                     (n, 128, 34, 34), 1))
    for label, count, kind, x_shape, w_shape, y_shape, pad in runs:
        for layout in ("nchw", "nhwc"):
            ms, info = best_plan_ms(kind, x_shape, w_shape, y_shape, [pad, pad], [pad, pad],
                                    [1, 1], layout, "ieee")
            print(f"B ieee {layout} {label}: {count} x {ms:.3f} = {count * ms:.3f} ms ({info})",
                  flush=True)


def overlap_halves():
    """B's convolution (the pipeline's plan, its own output layout) whole and in two batch
    halves, and the fused pass over one half alone and beside the other half's convolution
    (L2 flushed, alternating rounds)."""
    from cufused import pipelines
    from cufused.benchmark import Timer

    timer = Timer(repeat=20)
    _, xs, ws, kw = CONVS["B"]
    x = cupy.random.default_rng(0).random(xs, dtype=cupy.float32)
    w = cupy.random.default_rng(1).random(ws, dtype=cupy.float32) - 0.5
    half = xs[0] // 2
    options = {"stride": 1, "padding": 0, **kw}
    args = check_conv_args(xs, ws, 2, transposed=True, **options)
    half_args = check_conv_args((half, *xs[1:]), ws, 2, transposed=True, **options)
    sign = cupy.ones(ws[1], dtype=cupy.float32)
    side = cupy.cuda.Stream(non_blocking=True)
    for precision in ("ieee", "tf32"):
        def conv(lo, hi, a):
            return conv_on_gpu(x[lo:hi], w, a, precision, convert_output=False)[0]

        y = conv(0, half, half_args)
        ext = cupy.empty((half, ws[1], y.shape[2] // 2, y.shape[3] // 2), dtype=cupy.float32)
        variant = pipelines._fused_pass_variant(y, 2)

        def fused_pass():
            pipelines._pool_extremum_stats(cupy, y, ext, 2, bias=None, sign_a=sign,
                                           sign_b=None, shift_group=1, per_sample=False,
                                           variant=variant)

        def overlapped():
            main = cupy.cuda.get_current_stream()
            side.wait_event(main.record())
            with side:
                fused_pass()
            conv(half, xs[0], half_args)
            main.wait_event(side.record())

        ms = timer.compare({"whole conv": lambda: conv(0, xs[0], args),
                            "two half convs": lambda: (conv(0, half, half_args),
                                                       conv(half, xs[0], half_args)),
                            "half conv": lambda: conv(half, xs[0], half_args),
                            "half pass": fused_pass,
                            "half conv beside half pass": overlapped})
        print(f"B {precision} halves: " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items()),
              flush=True)


def _engine_plans(graph, *, all_knobs: bool, cap: int = 64) -> int:
    """Add a plan per engine (default knobs), or per engine x knob setting (up to ``cap``
    settings per engine, 30 s at most); returns how many were accepted."""
    added, deadline = 0, time.time() + 30
    for engine in range(graph.get_engine_count()):
        if time.time() > deadline:
            break
        settings = [{}]
        if all_knobs:
            try:
                axes = [[(k.type, v) for v in range(k.min_value, k.max_value + 1,
                                                    max(k.stride, 1))][:16]
                        for k in graph.get_knobs_for_engine(engine)]
            except Exception:  # noqa: BLE001 - engine not supported for this graph
                continue
            settings = [dict(c) for c in itertools.islice(itertools.product(*axes), cap)]
        for knobs in settings:
            try:
                graph.create_execution_plan(engine, knobs)
                added += 1
            except Exception:  # noqa: BLE001
                continue
    return added


def every_engine_and_knob():
    """Plans of the heuristics' list against every engine (default knobs) and every engine x
    knob setting, per canonical convolution: time of each plan (single-run screen first), and
    the fastest plan's largest difference from the heuristics' fastest."""
    cudnn = _cudnn.import_cudnn()
    cases = (("B dgrad", "dgrad", (512, 64, 32, 32), (64, 128, 5, 5), (512, 128, 34, 34), 1,
              "nchw", "ieee"),
             ("B fprop(flipped)", "fprop", (512, 64, 32, 32), (128, 64, 5, 5),
              (512, 128, 34, 34), 3, "nchw", "ieee"),
             ("A fprop", "fprop", (128, 8, 128, 128), (64, 8, 3, 3), (128, 64, 126, 126), 0,
              "nchw", "ieee"),
             ("C dgrad", "dgrad", (32, 32, 16, 32, 32), (32, 64, 3, 3, 3), (32, 64, 32, 64, 64),
              1, "nhwc", "tf32"))
    handle = _cudnn._handle()
    for name, kind, xs, ws, ys, pad, layout, precision in cases:
        nd = len(xs) - 2
        spec = _cudnn._PartSpec(kind, xs, _cudnn.layout_strides(xs, layout), ws,
                                _cudnn.layout_strides(ws, layout), ys,
                                _cudnn.layout_strides(ys, layout), (pad,) * nd, (pad,) * nd,
                                (2 if name.startswith("C") else 1,) * nd, (1,) * nd, None)
        rng = cupy.random.default_rng(1)
        arrays = [_cudnn.empty_in_layout(d, layout) for d in (xs, ws, ys)]
        for a in arrays[:2]:
            a[...] = rng.random(a.shape, dtype=cupy.float32) - 0.5
        reference = None
        if precision == "ieee":  # float64 on the first sample (C's is too slow on the CPU)
            from cufused import reference as ref
            x0, w0 = cupy.asnumpy(arrays[0][:1]), cupy.asnumpy(arrays[1])
            reference = (ref.conv_transpose(x0, w0, None, (1,) * nd, (pad,) * nd, (0,) * nd,
                                            (1,) * nd, 1) if kind == "dgrad"
                         else ref.conv(x0, w0, None, (1,) * nd, (pad,) * nd, (1,) * nd, 1))
        outputs = {}
        for label, all_knobs in (("heuristics", None), ("engines", False), ("knobs", True)):
            t0 = time.time()
            g, tensors = _cudnn._build_graph(spec, precision)
            heuristic = g.get_execution_plan_count()
            added = 0 if all_knobs is None else _engine_plans(g, all_knobs=all_knobs)
            if precision == "ieee":
                g.deselect_numeric_notes([cudnn.numerical_note.TENSOR_CORE,
                                          cudnn.numerical_note.DOWN_CONVERT_INPUTS])
            g.check_support()
            g.build_plans(cudnn.build_plan_policy.ALL)
            built = time.time() - t0
            pack = {t: a.data.ptr for t, a in zip(tensors, arrays)}
            results = []
            for i in range(g.get_execution_plan_count()):
                if time.time() - t0 > 60:
                    break
                try:
                    ws_buf = cupy.empty(max(g.get_workspace_size_plan_at_index(i), 1),
                                        cupy.uint8)
                    run = lambda: g.execute_plan_at_index(  # noqa: E731
                        pack, ws_buf.data.ptr, i, handle=handle)
                    once = _cudnn._time_ms(run, repeat=1, batch=1)
                    if results and once > 1.3 * min(r[0] for r in results):
                        continue
                    results.append((_cudnn._time_ms(run, repeat=3, batch=2),
                                    g.get_plan_name_at_index(i), i))
                except Exception:  # noqa: BLE001
                    continue
            if not results:
                print(f"{label:10s} {name} {layout} {precision}: nothing timed in 60 s")
                continue
            results.sort()
            ms, plan, i = results[0]
            ws_buf = cupy.empty(max(g.get_workspace_size_plan_at_index(i), 1), cupy.uint8)
            arrays[2].fill(cupy.nan)
            g.execute_plan_at_index(pack, ws_buf.data.ptr, i, handle=handle)
            outputs[label] = arrays[2].copy()
            diff = float(cupy.abs(outputs[label] - outputs["heuristics"]).max()
                         / cupy.abs(outputs["heuristics"]).max())
            top = "; ".join(f"{m:.3f} {p}" for m, p, _ in results[:4])
            if reference is not None:
                got = cupy.asnumpy(outputs[label][:1]).astype(numpy.float64)
                top += (f"; its error vs float64 (sample 0) "
                        f"{abs(got - reference).max() / abs(reference).max():.2e}")
            print(f"{label:10s} {name} {layout} {precision}: {heuristic}+{added} plans, built in "
                  f"{built:.1f} s, timed {len(results)}; max diff from heuristics' best "
                  f"{diff:.2e}; fastest: {top}  [{time.time() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    which = sys.argv[1:] or ["host", "bias", "flip", "subpixel", "mixed"]
    for name, fn in (("host", host_breakdown), ("bias", bias_in_graph),
                     ("flip", flipped_fprop_for_b), ("subpixel", subpixel_for_c),
                     ("mixed", mixed_layouts), ("strided", subpixel_strided),
                     ("halves", overlap_halves), ("bforms", b_formulations),
                     ("knobs", every_engine_and_knob)):
        if name in which:
            t0 = time.time()
            fn()
            print(f"[{name} done in {time.time() - t0:.0f} s]", flush=True)
