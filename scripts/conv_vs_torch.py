"""Public cufused convolutions against PyTorch's cuDNN call on the same operands, paired
(device): where both run the same cuDNN engine, is the difference more than noise?

Each round times both calls once (CUDA events, L2 flushed, the order alternating between
rounds); per case and precision it prints the medians, the median of the per-round ratios
torch / cufused and a 95 % bootstrap interval of that median (resampled rounds).
Usage: python scripts/conv_vs_torch.py [ROUNDS] (default 200)
"""

import sys

import cupy
import numpy
import torch

from cufused import _cudnn
from cufused.benchmark import Timer, _public_conv, make_cases, set_torch_precision


def main(rounds):
    rng = numpy.random.default_rng(0)
    boot = numpy.random.default_rng(1)
    timer = Timer(repeat=rounds)
    print(torch.cuda.get_device_name(), f"{rounds} rounds")
    for case in make_cases():
        fn, opts = _public_conv(case)
        x = cupy.asarray(rng.random(case.conv["x_shape"], dtype=numpy.float32))
        w = cupy.asarray(rng.uniform(-0.1, 0.1, case.conv["w_shape"]).astype(numpy.float32))
        xt, wt = torch.as_tensor(x, device="cuda"), torch.as_tensor(w, device="cuda")
        torch_fn = getattr(torch.nn.functional, fn.__name__)
        for precision in ("ieee", "tf32"):
            set_torch_precision(precision)
            with torch.no_grad():
                t = timer.samples({"cufused": lambda: fn(x, w, precision=precision, **opts),
                                   "torch": lambda: torch_fn(xt, wt, **opts)})
            ratio = t["torch"] / t["cufused"]
            medians = [numpy.median(boot.choice(ratio, ratio.size)) for _ in range(2000)]
            lo, hi = numpy.percentile(medians, [2.5, 97.5])
            plans = [p for k, p in _cudnn._plans.items()
                     if k[1].x_shape == x.shape and k[1].precision == precision]
            how = ", ".join(f"{p.strategy.label} {'replayed' if p.replays else 'direct'}"
                            for p in plans)
            print(f"{case.name} {precision} ({how}): cufused {numpy.median(t['cufused']):.3f} ms, "
                  f"torch {numpy.median(t['torch']):.3f} ms; torch/cufused per round: median "
                  f"{numpy.median(ratio):.4f}, 95 % interval [{lo:.4f}, {hi:.4f}]", flush=True)
    set_torch_precision("ieee")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
