"""The three fused pipelines, fused and unfused, both precisions, canonical and small sizes."""

import numpy

from .common import gpu_ms, require_gpu


class Pipelines:
    params = (["A", "B", "C"], ["ieee", "tf32"], ["fused", "unfused"], ["canonical", "small"])
    param_names = ["case", "precision", "method", "size"]
    timeout = 900

    def setup(self, case, precision, method, size):
        require_gpu()
        from cufused.bench.cases import make_cases

        self.case = next(c for c in make_cases(small=size == "small") if c.name == case)
        self.inputs = self.case.make_inputs(numpy.random.default_rng(0))
        self.run = lambda: self.case.run_cufused(self.inputs, precision=precision, method=method)
        self.run()  # compile kernels, choose and build the cuDNN plan

    def track_gpu_ms(self, case, precision, method, size):
        return gpu_ms(self.run)

    track_gpu_ms.unit = "ms"
