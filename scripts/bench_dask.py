"""Dask's overhead on one GPU: images per second of each pipeline over a dask array of
FACTOR x the canonical batch in chunks of the canonical batch, against a plain Python loop
over the same chunks (issue 28's target: at most 10 % slower).

Each figure is the median wall time of ``--repeat`` runs after one warm-up, from the first
call issued to the device being idle, with every result kept until then (as Dask's
``persist`` keeps its chunks): the loop calls the pipeline on each chunk; for pipeline B it
runs the same three phases that ``cufused.dask`` runs (the batch statistics span all chunks),
and the column "B 1-call" is one fused call per chunk (each chunk's own statistics: another
result, shown for its cost). Dask runs in this process with the threaded scheduler and with
the synchronous one (every task in the calling thread, as the loop issues its calls) and,
where ``dask_cuda`` imports, on a ``LocalCUDACluster`` with one worker per GPU: for each
count in ``--gpus``, the input is made on that many workers and the pipeline runs on them
only (one cluster serves every count, so each worker builds its convolution plans once). The
loop's time is this process's; ``--cluster-only`` leaves out the loop and the in-process
schedulers. For each cluster figure, one more run's task stream says where the time goes:
the busiest worker's task time, transfer time between workers, and the rest of the wall time
(scheduling, and the device finishing after the last task returns).

Without a GPU, ``--small`` is a smoke run of the same code on NumPy chunks (the float64
reference) with small shapes and the in-process schedulers only.

Usage: python scripts/bench_dask.py [--small] [--cases A B C] [--precisions ieee tf32]
       [--factor 8] [--batch N] [--repeat 3] [--threads N] [--no-cluster]
       [--gpus 1 2] [--cluster-only] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time

import numpy

import cufused
from cufused._arrays import gpu_available
from cufused.bench.cases import make_cases


def _sync(xp) -> None:
    if xp is not numpy:
        xp.cuda.Device().synchronize()


def wall_time(fn, xp, repeat: int) -> float:
    """Median seconds of ``fn()`` from the first call issued to the device being idle, after
    one warm-up run; each run's result is kept until then."""
    fn()
    times = []
    for _ in range(repeat):
        _sync(xp)
        start = time.perf_counter()
        result = fn()
        _sync(xp)
        times.append(time.perf_counter() - start)
        del result
    return statistics.median(times)


def b_phases_loop(chunks, weight, bn_weight, bn_bias, gn_weight, gn_bias, *, num_groups,
                  stride=1, padding=0, output_padding=0, groups=1, conv_bias=None,
                  pool_kernel=2, eps=1e-5, precision):
    """Pipeline B over ``chunks`` as one batch without Dask: ``cufused.dask``'s phases, one
    after another in this thread."""
    from cufused.dask._pipelines import _phases
    from cufused.dask._statistics import _finish_statistics, _merge_moments

    x = chunks[0]
    xp = cufused._arrays.get_array_module(x=x)
    conv_shape = cufused.conv_transpose2d(x[:0], weight, stride=stride, padding=padding,
                                          output_padding=output_padding, groups=groups).shape
    phase1, constants, phase3 = _phases(
        xp, weight, conv_bias, bn_weight, conv_shape=(1, *conv_shape[1:]), pool=pool_kernel,
        num_groups=num_groups, eps=eps, dtype=x.dtype, precision=precision, stride=stride,
        padding=padding, output_padding=output_padding, groups=groups)
    parts = [phase1(c, *constants.values()) for c in chunks]
    mean, var, _, _ = _finish_statistics(
        _merge_moments(*(moments for _, moments in parts)), None, None, 0.0)
    return [phase3(pooled, mean, var, bn_weight, bn_bias, gn_weight, gn_bias)
            for pooled, _ in parts]


def _random_chunk(block_id=None, *, shape, seed):
    """One float32 chunk drawn where the task runs (a worker's GPU)."""
    import cupy

    rng = cupy.random.default_rng(seed + block_id[0])
    return rng.random(shape, dtype=cupy.float32)


def bench_case(case, xp, params, x_shape, factor, precisions, repeat, threads, client, gpus,
               local=True):
    """The rows of one case: {precision: {runner: seconds}}."""
    n = x_shape[0]
    total = (factor * n,) + x_shape[1:]
    rows = {precision: {} for precision in precisions}
    if local:
        for precision, times in local_times(case, xp, params, total, n, precisions, repeat,
                                            threads).items():
            rows[precision].update(times)
        if xp is not numpy:
            # The cluster's workers share this GPU: give them what this process keeps (the
            # whole-call graphs' temporaries, the plans' graphs, the pool's free blocks).
            cufused.clear_caches()
            xp.get_default_memory_pool().free_all_blocks()
    if client is not None:
        for precision in precisions:
            opts = dict(case.options, precision=precision)
            # The most GPUs first: each worker builds its plans in that warm-up, all at once.
            for count in sorted(gpus, reverse=True):
                seconds, where = cluster_time(client, count, case.pipeline, params, opts,
                                              total, n, repeat)
                rows[precision][f"cluster{count}"] = seconds
                rows[precision][f"cluster{count}_where"] = where
    return rows


def local_times(case, xp, params, total, n, precisions, repeat, threads):
    """The loop's and the threaded scheduler's seconds in this process, and a timeline."""
    import dask.array as da

    from cufused import dask as cdask

    if xp is numpy:
        x = numpy.random.default_rng(1).random(total, dtype=numpy.float32)
    else:
        x = xp.random.default_rng(1).random(total, dtype=xp.float32)
    chunks = [x[i * n:(i + 1) * n] for i in range(total[0] // n)]
    # name=False: no hash of the whole input (for CuPy, a copy to the host and back).
    x_dask = da.from_array(x, chunks={0: n}, asarray=False, name=False).persist(
        scheduler="threads")
    single = getattr(cufused, case.pipeline)
    lazy = getattr(cdask, case.pipeline)
    rows = {}
    for precision in precisions:
        opts = dict(case.options, precision=precision)
        runners = {}
        if case.name == "B":
            runners["loop"] = lambda: b_phases_loop(chunks, *params, **opts)
            runners["one_call_per_chunk"] = lambda: [single(c, *params, **opts) for c in chunks]
        else:
            runners["loop"] = lambda: [single(c, *params, **opts) for c in chunks]
        runners["threads"] = lambda: lazy(x_dask, *params, **opts).persist(
            scheduler="threads", num_workers=threads)
        runners["sync"] = lambda: lazy(x_dask, *params, **opts).persist(scheduler="sync")
        rows[precision] = {name: wall_time(fn, xp, repeat) for name, fn in runners.items()}
        rows[precision]["timeline"] = task_timeline(runners["threads"], xp)
    return rows


def task_timeline(run, xp) -> dict:
    """Where a threaded run's wall time goes, in ms (host clock, one run after the timed
    ones): ``start``, from the call to the first task's start (graph building, Dask's
    optimization and scheduling); ``tasks``, the tasks' summed host time; ``gaps``, the
    time between one task's end and the next one's start, summed; ``tail``, from the last
    task's end to the device being idle."""
    from dask.callbacks import Callback

    marks = []

    class Marks(Callback):
        def _pretask(self, key, dask, state):
            marks.append(("start", time.perf_counter()))

        def _posttask(self, key, result, dask, state, worker_id):
            marks.append(("end", time.perf_counter()))

    _sync(xp)
    t0 = time.perf_counter()
    with Marks():
        result = run()
        _sync(xp)
    t1 = time.perf_counter()
    del result
    starts = sorted(t for kind, t in marks if kind == "start")
    ends = sorted(t for kind, t in marks if kind == "end")
    if not starts:
        return {}
    busy = sum(e - s for s, e in zip(starts, ends))
    gaps = sum(max(0.0, s - e) for e, s in zip(ends, starts[1:]))
    return {"tasks_n": len(starts), "start": (starts[0] - t0) * 1e3, "tasks": busy * 1e3,
            "gaps": gaps * 1e3, "tail": (t1 - ends[-1]) * 1e3, "total": (t1 - t0) * 1e3}


def cluster_time(client, count, pipeline, params, opts, total, n, repeat):
    """Median seconds on the cluster's first ``count`` workers, input made and kept there
    first, and where one more run's wall time goes (seconds): ``tasks``, the busiest worker's
    summed task time; ``transfer``, time spent moving data between workers (summed);
    ``rest``, the wall time beyond the busiest worker's tasks and transfers; ``loop``, the
    slowest worker's time for one call per chunk it holds, issued by the worker itself with
    no scheduler in between (B: each chunk's own statistics), from first call to device idle.
    """
    import cupy
    import dask.array as da
    from distributed import futures_of, get_task_stream, wait

    from cufused import dask as cdask

    lazy = getattr(cdask, pipeline)
    workers = sorted(client.scheduler_info()["workers"])[:count]
    x = da.map_blocks(_random_chunk, shape=(n,) + total[1:], seed=1, chunks=(
        (n,) * (total[0] // n),) + tuple((s,) for s in total[1:]), dtype=numpy.float32,
        meta=cupy.empty((0,) * len(total), dtype=cupy.float32))
    x = client.persist(x, workers=workers, allow_other_workers=False)
    with client.as_current():
        wait(futures_of(x))

    def run():
        out = client.persist(lazy(x, *params, **opts), workers=workers,
                             allow_other_workers=False)
        with client.as_current():
            wait(futures_of(out))
        client.run(lambda: cupy.cuda.Device().synchronize(), workers=workers)
        return out

    run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
        del out
    start = time.perf_counter()
    with get_task_stream(client) as stream:
        out = run()
    wall = time.perf_counter() - start
    del out
    busy = {w: 0.0 for w in workers}
    transfer = 0.0
    for task in stream.data:
        for span in task["startstops"]:
            if span["action"] == "compute":
                busy[task["worker"]] = busy.get(task["worker"], 0.0) + span["stop"] - span[
                    "start"]
            elif span["action"] == "transfer":
                transfer += span["stop"] - span["start"]
    tasks = max(busy.values())
    keys = {}
    for key, holders in client.who_has(x).items():
        keys.setdefault(holders[0], []).append(key)
    host_params = [cupy.asnumpy(p) for p in params]
    loops = client.run(_worker_loop, pipeline, keys, host_params, opts, repeat,
                       workers=workers)
    return statistics.median(times), {"wall": wall, "tasks": tasks, "transfer": transfer,
                                      "rest": max(0.0, wall - tasks - transfer),
                                      "loop": max(loops.values())}


def _worker_loop(pipeline, keys, params, opts, repeat, dask_worker=None):
    """On a worker: median seconds of one call per chunk this worker holds, from the first
    call to the device being idle."""
    import cupy

    # Tuple keys come back as lists from the client's message.
    chunks = [dask_worker.data[tuple(key) if isinstance(key, list) else key]
              for key in keys.get(dask_worker.address, [])]
    params = [cupy.asarray(p) for p in params]
    single = getattr(cufused, pipeline)
    return wall_time(lambda: [single(c, *params, **opts) for c in chunks], cupy, repeat)


def header(xp, args) -> dict:
    import dask

    info = {"cufused": cufused.__version__, "dask": dask.__version__,
            "python": platform.python_version(), "factor": args.factor,
            "repeat": args.repeat}
    if xp is numpy:
        info["device"] = "CPU (NumPy chunks)"
    else:
        props = xp.cuda.runtime.getDeviceProperties(xp.cuda.runtime.getDevice())
        name = props["name"]
        info["device"] = name.decode() if isinstance(name, bytes) else name
    try:
        import dask_cuda

        info["dask_cuda"] = dask_cuda.__version__
    except ImportError:
        pass
    return info


def format_table(result: dict) -> str:
    """Images per second of each runner, Dask's overhead over the loop, and each GPU
    count's speed-up over one GPU."""
    gpus = result["header"].get("gpus", [])
    head = (f"{'case':<4} {'prec':<5} {'images':>7} {'chunk':>6} {'loop':>9} {'threads':>9} "
            f"{'ovh':>7} {'sync':>9} {'ovh':>7}")
    for count in gpus:
        head += f" {f'{count} GPU':>9} {'ovh' if count == 1 else 'speedup':>7}"
    lines = [" ".join(f"{k}={v}" for k, v in result["header"].items()),
             "images/s (median wall time, issue to device idle); ovh = time / loop - 1; "
             "speedup = 1 GPU's time / this time", head + f" {'B 1-call':>9}"]
    for r in result["rows"]:
        def rate(key):
            return f"{r['images'] / r[key]:9.1f}" if key in r else f"{'-':>9}"

        def ratio(key, base, minus):
            if key in r and base in r:
                return f"{r[key] / r[base] - 1:+7.1%}" if minus else f"{r[base] / r[key]:7.2f}"
            return f"{'-':>7}"

        line = (f"{r['case']:<4} {r['precision']:<5} {r['images']:>7} {r['chunk']:>6} "
                f"{rate('loop')} {rate('threads')} {ratio('threads', 'loop', True)} "
                f"{rate('sync')} {ratio('sync', 'loop', True)}")
        for count in gpus:
            key = f"cluster{count}"
            line += (f" {rate(key)} " + (ratio(key, "loop", True) if count == 1
                                         else ratio(key, "cluster1", False)))
        lines.append(line + f" {rate('one_call_per_chunk')}")
    return "\n".join(lines)


def format_where(result: dict) -> list[str]:
    """Where each cluster run's wall time goes, in ms."""
    lines = []
    for r in result["rows"]:
        for count in result["header"].get("gpus", []):
            w = r.get(f"cluster{count}_where")
            if w:
                lines.append(f"{r['case']:<4} {r['precision']:<5} {count} GPU: wall "
                             f"{w['wall'] * 1e3:8.2f}  busiest worker's tasks "
                             f"{w['tasks'] * 1e3:8.2f}  transfers {w['transfer'] * 1e3:7.2f}  "
                             f"rest {w['rest'] * 1e3:7.2f}  worker loop {w['loop'] * 1e3:8.2f}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true",
                        help="small shapes (a GPU smoke run; without a GPU, NumPy chunks)")
    parser.add_argument("--cases", nargs="*", choices=["A", "B", "C"], default=["A", "B", "C"])
    parser.add_argument("--precisions", nargs="*", choices=["ieee", "tf32", "3xtf32"],
                        default=["ieee", "tf32"], help="GPU precisions (default ieee tf32)")
    parser.add_argument("--factor", type=int, default=8, help="chunks per dask array (8)")
    parser.add_argument("--batch", type=int, help="images per chunk (default: the case's)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per figure (3)")
    parser.add_argument("--threads", type=int, help="threaded scheduler's workers (Dask's "
                                                    "default)")
    parser.add_argument("--no-cluster", action="store_true", help="skip the LocalCUDACluster")
    parser.add_argument("--gpus", nargs="*", type=int, default=[1],
                        help="GPU counts to run the cluster on (default 1)")
    parser.add_argument("--cluster-only", action="store_true",
                        help="leave out the loop and the threaded scheduler")
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    args = parser.parse_args(argv)
    gpu = gpu_available()
    if not gpu and not args.small:
        print("no CUDA GPU available: only --small runs without one (NumPy chunks)")
        return 1
    if gpu:
        import cupy as xp
    else:
        xp, args.precisions = numpy, ["ieee"]
    client = None
    if gpu and not args.no_cluster:
        try:
            import dask_cuda
            from distributed import Client

            client = Client(dask_cuda.LocalCUDACluster(n_workers=max(args.gpus),
                                                       dashboard_address=None),
                            set_as_default=False)
        except Exception as exc:  # noqa: BLE001 - the threaded figures stand without it
            print(f"no LocalCUDACluster ({type(exc).__name__}: {exc}): no cluster column")
    result = {"header": header(xp, args), "rows": []}
    if client is not None:
        result["header"]["gpus"] = args.gpus
    print("\n".join(format_table(result).splitlines()[:3]), flush=True)
    try:
        for case in make_cases(small=args.small):
            if case.name not in args.cases:
                continue
            shape = tuple(case.shapes["x"])
            if args.batch:
                shape = (args.batch,) + shape[1:]
            # The parameters as the benchmark draws them (x: one sample, unused).
            one = dataclasses.replace(case, shapes={**case.shapes, "x": (1,) + shape[1:]})
            inputs = one.make_inputs(numpy.random.default_rng(0))
            params = [xp.asarray(v) for k, v in inputs.items() if k != "x"]
            rows = bench_case(case, xp, params, shape, args.factor, args.precisions,
                              args.repeat, args.threads, client, args.gpus,
                              local=not args.cluster_only)
            if xp is not numpy:  # the case's arrays are gone: give their memory back
                xp.get_default_memory_pool().free_all_blocks()
            for precision, times in rows.items():
                result["rows"].append(dict(case=case.name, precision=precision,
                                           images=args.factor * shape[0], chunk=shape[0],
                                           **times))
                print(format_table(result).splitlines()[-1], flush=True)
    finally:
        if client is not None:
            client.close()
            client.cluster.close()
    print()
    print(format_table(result))
    print("threaded run, ms: start (to the first task) / tasks' host time / gaps between "
          "tasks / tail (to device idle) / total")
    for r in result["rows"]:
        t = r.get("timeline") or {}
        if t:
            print(f"{r['case']:<4} {r['precision']:<5} {t['tasks_n']:3d} tasks  "
                  f"{t['start']:7.2f} {t['tasks']:7.2f} {t['gaps']:7.2f} {t['tail']:7.2f} "
                  f"{t['total']:7.2f}")
    where = format_where(result)
    if where:
        print("cluster runs, ms: wall / the busiest worker's summed task time / transfers "
              "between workers (summed) / the rest / the slowest worker's loop over its "
              "chunks without the scheduler")
        print("\n".join(where))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
