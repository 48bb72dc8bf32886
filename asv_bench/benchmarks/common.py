"""GPU setup shared by the benchmarks: skip cleanly without a GPU, time with CUDA events."""

import os
import sys

# asv's "existing" environment runs against the checkout, not an installed copy.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def require_gpu():
    """Raise NotImplementedError (asv's "skip") when no CUDA device is usable."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception as exc:  # noqa: BLE001 - no CuPy, driver or device
        raise NotImplementedError(f"needs a CUDA GPU ({exc})") from exc


def gpu_ms(fn, repeat=10):
    """Median GPU milliseconds of fn() with CUDA events and an L2 flush (cufused.bench.timing)."""
    from cufused.bench.timing import Timer

    return Timer(repeat=repeat, warmup=2)(fn)
