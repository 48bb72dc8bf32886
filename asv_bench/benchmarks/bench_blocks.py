"""Building blocks on the tensors the pipelines produce (canonical and small sizes)."""

from .common import gpu_ms, require_gpu

# name -> (shape at canonical size, shape at small size, call)
BLOCKS = {
    "group_norm": ((128, 64, 126, 126), (8, 64, 62, 62),
                   lambda cf, x: cf.group_norm(x, 16)),
    "batch_norm_tanh": ((512, 128, 34, 34), (16, 128, 18, 18),
                        lambda cf, x: cf.batch_norm(x, activation="tanh")),
    "max_pool2d": ((128, 64, 126, 126), (8, 64, 62, 62), lambda cf, x: cf.max_pool2d(x, 4)),
    "avg_pool3d": ((32, 32, 32, 64, 64), (2, 32, 16, 32, 32), lambda cf, x: cf.avg_pool3d(x, 2)),
    "softmax_spatial": ((32, 64, 32, 64, 64), (2, 64, 16, 32, 32),
                        lambda cf, x: cf.softmax(x, axis=(2, 3, 4))),
}


class Blocks:
    params = (list(BLOCKS), ["canonical", "small"])
    param_names = ["block", "size"]
    timeout = 600

    def setup(self, block, size):
        require_gpu()
        import cupy

        import cufused

        canonical, small, call = BLOCKS[block]
        shape = canonical if size == "canonical" else small
        x = cupy.random.default_rng(0).random(shape, dtype=cupy.float32)
        self.run = lambda: call(cufused, x)
        self.run()

    def track_gpu_ms(self, block, size):
        return gpu_ms(self.run)

    track_gpu_ms.unit = "ms"


class Convolutions:
    """The canonical convolutions alone (their cached plan, in the pipeline's layout)."""

    params = (["A", "B", "C"], ["ieee", "tf32"])
    param_names = ["case", "precision"]
    timeout = 900

    def setup(self, case, precision):
        require_gpu()
        from cufused.bench.cases import make_cases
        from cufused.bench.timing import conv_plan_for

        self.plan = conv_plan_for(next(c for c in make_cases() if c.name == case), precision)
        self.arrays = self.plan.example_operands()

    def track_gpu_ms(self, case, precision):
        return gpu_ms(lambda: self.plan.run(*self.arrays))

    track_gpu_ms.unit = "ms"
