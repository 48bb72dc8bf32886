"""The bench result as ``python -m cufused bench`` prints it (a side-by-side table) and draws it
(a bar chart); the docs render the committed results with :func:`format_table`."""

from __future__ import annotations

import os


def format_table(result: dict) -> str:
    """The side-by-side table of a ``bench`` result: the pipelines, the host time per call,
    then the convolutions."""
    return "\n".join(_pipeline_lines(result) + [""] + _host_lines(result) + [""]
                     + _conv_lines(result))


def _cell(row: dict, key: str, fmt: str = "7.3f") -> str:
    """``row[key]`` formatted, or a dash of the same width where the row lacks it."""
    return format(row[key], fmt) if key in row else "-".rjust(int(fmt.split(".")[0]))


def _cells(row: dict, *cells: tuple[str, str]) -> str:
    """The row's case and precision, then each ``(key, format)`` cell, space-separated."""
    return " ".join([f"{row['case']:<4} {row['precision']:<6}"]
                    + [_cell(row, key, fmt) for key, fmt in cells])


def _host_lines(result: dict) -> list[str]:
    """A row per case and precision: the prepared call's and PyTorch's times, host
    microseconds per warm call, and a single call's latency over back-to-back device time."""
    rows = [r for r in result["rows"] if "host_us_fused" in r]  # older results lack them
    if not rows:
        return []
    lines = ["warm calls: ms (L2 flushed) of the prepared call and of torch.compile "
             "reduce-overhead; host us per call (back to back; fused: out given, new: "
             "without out); latency = one fused call after the flush / back-to-back device "
             "ms per call",
             f"{'case':<4} {'prec':<6} {'prepared':>8} {'comp-ro':>8} {'host fused':>10} "
             f"{'new':>6} {'prepared':>8} {'eager':>7} {'compile':>7} {'comp-ro':>7} "
             f"{'latency':>7}"]
    for r in rows:
        lines.append(_cells(r, ("prepared", "8.3f"), ("torch_compile_ro", "8.3f"),
                            ("host_us_fused", "10.1f"), ("host_us_fused_new", "6.1f"),
                            ("host_us_prepared", "8.1f"),
                            ("host_us_torch_eager", "7.1f"), ("host_us_torch_compile", "7.1f"),
                            ("host_us_torch_compile_ro", "7.1f"))
                     + f" {r['fused'] / r['fused_back_to_back']:7.3f}")
    return lines


def _pipeline_lines(result: dict) -> list[str]:
    """The header, the ceilings and a row per case and precision: times, speedups, floors."""
    ceil = result["ceilings"]
    header = result["header"]
    lines = [" ".join(f"{k}={v}" for k, v in header.items() if not isinstance(v, dict)),
             *([" ".join(f"{k}={v}" for k, v in header["options"].items())]
               if "options" in header else []),
             f"ceilings: copy {ceil['copy_TBps']:.2f} TB/s, fp32 {ceil['fp32_TFLOPs']:.1f} "
             f"TFLOP/s" + (f", tf32 {ceil['tf32_TFLOPs']:.0f} TFLOP/s" if 'tf32_TFLOPs' in ceil
                           else ""),
             "median ms, L2 flushed; speedup = PyTorch time / cufused fused time; floor: the "
             "direct convolution's FLOPs at the GEMM rate, or the input and output at the "
             "copy bandwidth (FFT / Winograd plans may beat it)",
             f"{'case':<4} {'prec':<6} {'fused':>7} {'unfused':>8} {'eager':>7} {'compile':>8} "
             f"{'xeager':>7} {'xcompile':>8} {'conv':>6} {'post':>6} "
             f"{'postfloor':>9} {'post/pf':>7} {'floor':>6} {'/floor':>6}  conv strategy"]
    for r in result["rows"]:
        xe = r["torch_eager"] / r["fused"] if "torch_eager" in r else float("nan")
        xc = r["torch_compile"] / r["fused"] if "torch_compile" in r else float("nan")
        # Results without conv_engine say only whether the pass ran in the epilogue.
        engine = r.get("conv_engine", "epilogue" if r.get("conv_in_epilogue") else "cudnn")
        if engine != "cudnn":
            # The convolution ran on an engine of cufused's, not the cuDNN plan whose time
            # the conv column would hold (the table of convolutions alone has both).
            conv = f" {'-':>6} {'-':>6} {r['post_floor']:9.3f} {'-':>7}"
            strategy = ("igemm, pass in its epilogue" if engine == "epilogue"
                        else f"{engine}, pass after it")
        else:
            post = r["fused"] - r["conv"]
            conv = (f" {r['conv']:6.3f} {post:6.3f} {r['post_floor']:9.3f} "
                    f"{post / r['post_floor']:7.2f}")
            # How the plan's warm calls ran (older results do not say).
            calls = f" ({r['conv_calls']})" if "conv_calls" in r else ""
            strategy = f"{r['conv_layout']}{calls}"
        lines.append(
            _cells(r, ("fused", "7.3f"), ("unfused", "8.3f"), ("torch_eager", "7.3f"),
                   ("torch_compile", "8.3f"))
            + f" {xe:7.2f} {xc:8.2f}{conv} {_floor_cells(r)}  "
            f"{strategy}")
    return lines


def _floor_cells(row: dict) -> str:
    """The floor and the fused time over it; dashes where no floor was measured."""
    if row.get("floor") is None:
        return f"{'-':>6} {'-':>6}"
    return f"{row['floor']:6.3f} {row['fused'] / row['floor']:6.2f}"


def _conv_lines(result: dict) -> list[str]:
    """A row per case and precision: the convolution alone, cufused's and PyTorch's."""
    lines = ["convolutions alone (ms): cufused plan as the pipeline runs it (NCHW input "
             "where the pipeline gets one) and for an input in any layout (free), cufused public "
             "call (NCHW in/out) and PyTorch's, without / with a bias; cufused public call "
             "into a channels-last out from an NCHW input (pub cl) and from a channels-last one "
             "(cl>cl), and PyTorch's on channels-last tensors",
             f"{'case':<4} {'prec':<6} {'plan':>7} {'free':>7} {'public':>7} {'torch':>7} "
             f"{'torch/public':>12} {'+bias':>7} {'torch':>7} {'torch/public':>12} "
             f"{'pub cl':>7} {'free/cl':>7} {'cl>cl':>7} {'free/cl>cl':>10} {'torch cl':>8}  "
             "plan / free strategy"]
    for r in result["rows"]:
        tc, tb, pb, fr, cl, cc, tl = (r.get(k, float("nan")) for k in (
            "torch_conv", "torch_conv_bias", "conv_public_bias", "conv_free", "conv_public_cl",
            "conv_public_cl_in", "torch_conv_cl"))
        lines.append(f"{r['case']:<4} {r['precision']:<6} {r['conv']:7.3f} {fr:7.3f} "
                     f"{r['conv_public']:7.3f} {tc:7.3f} {tc / r['conv_public']:12.2f} "
                     f"{pb:7.3f} {tb:7.3f} {tb / pb:12.2f} {cl:7.3f} {fr / cl:7.2f} "
                     f"{cc:7.3f} {fr / cc:10.2f} {tl:8.3f}  {r['conv_layout']} / "
                     f"{r.get('conv_free_layout', '-')}")
    return lines


def plot_format(path: str) -> str | None:
    """The image format of ``path``'s extension that matplotlib writes, or None (then
    ``--plot`` is refused before the benchmark runs; needs matplotlib)."""
    from matplotlib.backend_bases import FigureCanvasBase

    extension = os.path.splitext(path)[1][1:].lower()
    return extension if extension in FigureCanvasBase.get_supported_filetypes() else None


def plot(result: dict, path: str) -> None:
    """Bar chart of the bench result (needs matplotlib: the ``bench`` extra), in the format
    that ``path``'s extension names (:func:`plot_format`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ("fused", "unfused", "torch_eager", "torch_compile")
            if any(k in r for r in result["rows"])]
    labels = [f"{r['case']} {r['precision']}" for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(keys)
    for j, key in enumerate(keys):
        ax.bar([i + j * width for i in range(len(labels))],
               [r.get(key, 0.0) for r in result["rows"]], width, label=key)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels)
    ax.set_ylabel("ms (median, L2 flushed)")
    ax.set_title(result["header"]["device"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120, format=plot_format(path))
    plt.close(fig)
