"""Shared by the cufused.torch tests: the KernelBench reference models, module pairs, operator
samples, the functional references and the operator lists."""

from __future__ import annotations

from conftest import rel_err

try:
    import torch
    from torch import nn

    import cufused.torch as cft
except ImportError:  # collected and skipped as oracle tests (see conftest.py)
    torch = nn = cft = None


# ------------------------------------------------ KernelBench level 2 reference models, verbatim


def kernelbench_models():
    """The three KernelBench level 2 models (``Model`` in each problem file)."""

    class ModelA(nn.Module):  # Conv2d_GroupNorm_Scale_MaxPool_Clamp
        def __init__(self, in_channels, out_channels, kernel_size, num_groups, scale_shape,
                     maxpool_kernel_size, clamp_min, clamp_max):
            super().__init__()
            self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
            self.group_norm = nn.GroupNorm(num_groups, out_channels)
            self.scale = nn.Parameter(torch.ones(scale_shape))
            self.maxpool = nn.MaxPool2d(kernel_size=maxpool_kernel_size)
            self.clamp_min = clamp_min
            self.clamp_max = clamp_max

        def forward(self, x):
            x = self.conv(x)
            x = self.group_norm(x)
            x = x * self.scale
            x = self.maxpool(x)
            return torch.clamp(x, self.clamp_min, self.clamp_max)

    class ModelB(nn.Module):  # ConvTranspose2d_BatchNorm_Tanh_MaxPool_GroupNorm
        def __init__(self, in_channels, out_channels, kernel_size, stride, padding, groups,
                     num_groups):
            super().__init__()
            self.conv_transpose = nn.ConvTranspose2d(in_channels, out_channels, kernel_size,
                                                     stride=stride, padding=padding)
            self.batch_norm = nn.BatchNorm2d(out_channels)
            self.tanh = nn.Tanh()
            self.max_pool = nn.MaxPool2d(kernel_size=2, stride=2)
            self.group_norm = nn.GroupNorm(num_groups=num_groups, num_channels=out_channels)

        def forward(self, x):
            x = self.conv_transpose(x)
            x = self.batch_norm(x)
            x = self.tanh(x)
            x = self.max_pool(x)
            return self.group_norm(x)

    class ModelC(nn.Module):  # ConvTranspose3d_AvgPool_Clamp_Softmax_Multiply
        def __init__(self, in_channels, out_channels, kernel_size, stride, padding,
                     output_padding, pool_kernel_size, clamp_min, clamp_max):
            super().__init__()
            self.avg_pool = nn.AvgPool3d(pool_kernel_size)
            self.conv_transpose = nn.ConvTranspose3d(in_channels, out_channels, kernel_size,
                                                     stride=stride, padding=padding,
                                                     output_padding=output_padding)
            self.clamp_min = clamp_min
            self.clamp_max = clamp_max
            self.scale = nn.Parameter(torch.ones(1, out_channels, 1, 1, 1))

        def forward(self, x):
            x = self.avg_pool(x)
            x = self.conv_transpose(x)
            x = torch.clamp(x, self.clamp_min, self.clamp_max)
            b, c, d, h, w = x.shape
            x = x.view(b, c, -1)
            x = torch.softmax(x, dim=2)
            x = x.view(b, c, d, h, w)
            return x * self.scale

    return {"A": ModelA, "B": ModelB, "C": ModelC}


def ours(name):
    return {"A": cft.Conv2dGroupNormScaleMaxPoolClamp,
            "B": cft.ConvTranspose2dBatchNormTanhMaxPoolGroupNorm,
            "C": cft.ConvTranspose3dAvgPoolClampSoftmaxMultiply}[name]


# (get_init_inputs(), get_inputs() shape): the canonical KernelBench sizes and small ones with
# odd sizes, for the CPU reference path.
CANONICAL = {
    "A": ([8, 64, 3, 16, (64, 1, 1), 4, 0.0, 1.0], (128, 8, 128, 128)),
    "B": ([64, 128, 5, 1, 1, 8, 8], (512, 64, 32, 32)),
    "C": ([32, 64, 3, 2, 1, 1, 2, 0.0, 1.0], (32, 32, 32, 64, 64)),
}
SMALL = {
    "A": ([3, 8, 3, 4, (8, 1, 1), 4, 0.0, 1.0], (2, 3, 19, 21)),
    "B": ([4, 8, 5, 1, 1, 8, 2], (3, 4, 7, 9)),
    "C": ([3, 4, 3, 2, 1, 1, 2, 0.0, 1.0], (2, 3, 6, 5, 7)),
}


def make_pair(name, init, seed=0, device="cpu", dtype=None):
    """The reference model and cufused's, each created after ``manual_seed(seed)``, with
    mixed-sign norm weights and scales (the same in both) so that no sign goes untested."""
    torch.manual_seed(seed)
    ref = kernelbench_models()[name](*init)
    torch.manual_seed(seed)
    mine = ours(name)(*init, precision="ieee")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for key, p in ref.named_parameters():
            if not key.startswith("conv"):
                p.copy_((torch.rand(p.shape, generator=gen) + 0.5)
                        * torch.where(torch.rand(p.shape, generator=gen) < 0.5, -1.0, 1.0))
    mine.load_state_dict(ref.state_dict())
    return ref.to(device, dtype), mine.to(device, dtype)


# ----------------------------------------------------------------- operator samples (opcheck)


def samples(device, dtype=None):
    """(args, kwargs) for every operator: small, odd sizes, mixed-sign parameters."""
    gen = torch.Generator().manual_seed(0)
    dtype = dtype or torch.float32

    def r(*shape, signed=False):
        t = torch.rand(shape, generator=gen, dtype=torch.float64)
        return (2 * t - 1 if signed else t).to(device, dtype)

    return {
        "conv2d": ((r(2, 4, 9, 7), r(6, 2, 3, 3, signed=True), r(6, signed=True)),
                   dict(stride=[2, 1], padding=1, groups=2, precision="ieee")),
        "conv3d": ((r(2, 3, 5, 6, 4), r(4, 3, 3, 3, 2, signed=True)), dict(dilation=(1, 2, 1))),
        "conv_transpose2d": ((r(2, 4, 5, 6), r(4, 3, 3, 3, signed=True), r(6, signed=True)),
                             dict(stride=2, padding=1, output_padding=1, groups=2)),
        "conv_transpose3d": ((r(1, 2, 3, 4, 3), r(2, 3, 3, 3, 3, signed=True)),
                             dict(stride=2, padding=1, output_padding=(1, 0, 1))),
        "group_norm": ((r(3, 6, 5, 7), 3, r(6, signed=True), r(6, signed=True)), dict(eps=1e-3)),
        "batch_norm": ((r(4, 5, 3, 7), r(5, signed=True), r(5, signed=True)),
                       dict(running_mean=r(5), running_var=r(5) + 0.5, momentum=0.2,
                            activation="tanh")),
        "max_pool2d": ((r(2, 3, 9, 8), 3), dict(stride=2, padding=1)),
        "max_pool3d": ((r(2, 3, 5, 4, 6), 2), {}),
        "avg_pool2d": ((r(2, 3, 9, 8), [3, 2]), {}),
        "avg_pool3d": ((r(1, 2, 6, 5, 4), 2), dict(stride=1)),
        "softmax": ((r(2, 3, 4, 5, signed=True),), dict(axis=(2, 3))),
        "conv2d_groupnorm_scale_maxpool_clamp": (
            (r(2, 3, 11, 13), r(8, 3, 3, 3, signed=True), r(8, signed=True),
             r(8, signed=True), r(8, signed=True), r(8, 1, 1, signed=True)),
            dict(num_groups=4, pool_kernel=2, clamp_min=-0.5, clamp_max=0.5)),
        "conv_transpose2d_batchnorm_tanh_maxpool_groupnorm": (
            (r(3, 4, 5, 6), r(4, 8, 3, 3, signed=True), r(8, signed=True), r(8, signed=True),
             r(8, signed=True), r(8, signed=True)),
            dict(num_groups=2, stride=1, padding=1, conv_bias=r(8), running_mean=r(8),
                 running_var=r(8) + 0.5)),
        "conv_transpose3d_avgpool_clamp_softmax_multiply": (
            (r(2, 3, 4, 6, 5), r(3, 4, 3, 3, 3, signed=True), r(1, 4, 1, 1, 1, signed=True)),
            dict(stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=0.0,
                 clamp_max=1.0, conv_bias=r(4, signed=True))),
    }


def functional_reference(name, args, kwargs):
    """A building block computed by PyTorch in float64 (the pipelines are checked through
    the modules against the KernelBench models): the output and the float64 keyword
    arguments after the call (batch_norm updates its running buffers)."""
    import torch.nn.functional as F

    # Copies: a float64 tensor's double() is the tensor itself, and batch_norm would update
    # the caller's running buffers, which the check compares with these.
    a = [x.detach().clone().double() if isinstance(x, torch.Tensor) else x for x in args]
    k = {key: v.detach().clone().double() if isinstance(v, torch.Tensor) else v
         for key, v in kwargs.items()}
    options = {key: v for key, v in k.items() if key != "precision"}
    if name == "batch_norm":
        y = torch.tanh(F.batch_norm(a[0], k["running_mean"], k["running_var"], a[1], a[2],
                                    training=True, momentum=k["momentum"]))
    elif name == "group_norm":
        y = F.group_norm(a[0], a[1], a[2], a[3], eps=k["eps"])
    elif name == "softmax":
        x = a[0]
        y = torch.softmax(x.reshape(*x.shape[:2], -1), 2).reshape(x.shape)
    else:
        y = getattr(F, name)(*a, **options)
    return y, k


def check_building_block(name, device, dtype, tol):
    args, kwargs = samples(device, dtype)[name]
    want, updated = functional_reference(name, args, kwargs)
    got = getattr(torch.ops.cufused, name)(*args, **kwargs)
    assert got.dtype == args[0].dtype and got.device == args[0].device and got.is_contiguous()
    assert rel_err(got.double().cpu().numpy(), want.cpu().numpy()) < tol
    for key in ("running_mean", "running_var"):  # updated in place, as PyTorch does
        if key in kwargs:
            assert rel_err(kwargs[key].double().cpu().numpy(), updated[key].cpu().numpy()) < tol


BLOCKS = ["conv2d", "conv3d", "conv_transpose2d", "conv_transpose3d", "group_norm",
          "batch_norm", "max_pool2d", "max_pool3d", "avg_pool2d", "avg_pool3d", "softmax"]
PIPELINES = ["conv2d_groupnorm_scale_maxpool_clamp",
             "conv_transpose2d_batchnorm_tanh_maxpool_groupnorm",
             "conv_transpose3d_avgpool_clamp_softmax_multiply"]
OPS = BLOCKS + PIPELINES
