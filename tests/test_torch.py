"""cufused.torch: the custom operators (opcheck), the KernelBench modules against the
KernelBench reference models, torch.compile / torch.export, forward-only errors; on a GPU also
the current stream, CUDA-graph capture and the host time added over the CuPy call."""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import rel_err

try:
    import torch
    from torch import nn

    import cufused.torch as cft
except ImportError:  # collected and skipped as oracle tests (see conftest.py)
    torch = nn = cft = None

pytestmark = pytest.mark.oracle


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

    a = [x.double() if isinstance(x, torch.Tensor) else x for x in args]
    k = {key: v.double() if isinstance(v, torch.Tensor) else v for key, v in kwargs.items()}
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


# -------------------------------------------------------------------------- CPU (CI) tests


BLOCKS = ["conv2d", "conv3d", "conv_transpose2d", "conv_transpose3d", "group_norm",
          "batch_norm", "max_pool2d", "max_pool3d", "avg_pool2d", "avg_pool3d", "softmax"]
PIPELINES = ["conv2d_groupnorm_scale_maxpool_clamp",
             "conv_transpose2d_batchnorm_tanh_maxpool_groupnorm",
             "conv_transpose3d_avgpool_clamp_softmax_multiply"]
OPS = BLOCKS + PIPELINES


def test_every_array_function_is_an_operator():
    import inspect

    import cufused

    # Every public cufused function that takes an array is an operator, with its signature.
    arrays = [n for n in cufused.__all__
              if "x" in inspect.signature(getattr(cufused, n)).parameters]
    assert sorted(arrays) == sorted(OPS) == sorted(cft.OPERATORS)
    for name in OPS:
        schema = getattr(torch.ops.cufused, name).default._schema
        assert schema.name == f"cufused::{name}"
        params = inspect.signature(getattr(cufused, name)).parameters
        assert [a.name for a in schema.arguments] == [p for p in params if p != "out"]
        for a in schema.arguments:
            p = params[a.name]
            assert a.kwarg_only == (p.kind == p.KEYWORD_ONLY), name
            if a.has_default_value():
                assert a.default_value == p.default or [p.default] * len(a.default_value) \
                    == a.default_value, (name, a.name)




@pytest.mark.parametrize("name", OPS)
def test_opcheck_cpu(name):
    args, kwargs = samples("cpu")[name]
    torch.library.opcheck(getattr(torch.ops.cufused, name).default, args, kwargs)


@pytest.mark.parametrize("name", BLOCKS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_building_blocks_match_torch_functional_cpu(name, dtype):
    check_building_block(name, "cpu", getattr(torch, dtype), 1e-6 if dtype == "float32" else 1e-12)


def test_noncontiguous_cpu_input():
    x = torch.rand(2, 7, 5, 3, dtype=torch.float64).permute(0, 3, 2, 1)  # (2, 3, 5, 7) strided
    w = torch.rand(4, 3, 3, 3, dtype=torch.float64) - 0.5
    got = torch.ops.cufused.conv2d(x, w, padding=1)
    ref = torch.nn.functional.conv2d(x, w, padding=1)
    assert rel_err(got.numpy(), ref.numpy()) < 1e-12


@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_modules_init_and_state_dict_as_kernelbench(name):
    init = SMALL[name][0]
    torch.manual_seed(7)
    ref = kernelbench_models()[name](*init)
    torch.manual_seed(7)
    mine = ours(name)(*init)
    # Same parameters and buffers under the same names, initialized the same way.
    ref_state, my_state = ref.state_dict(), mine.state_dict()
    assert list(my_state) == list(ref_state)
    for key, value in ref_state.items():
        assert torch.equal(my_state[key], value), key
    assert any(not torch.equal(v, torch.ones_like(v)) for v in my_state.values())
    # And a state_dict loads both ways, strictly.
    mine.load_state_dict(kernelbench_models()[name](*init).state_dict())
    ref.load_state_dict(ours(name)(*init).state_dict())


def test_kernelbench_b_groups_is_ignored_as_in_kernelbench():
    model = cft.ConvTranspose2dBatchNormTanhMaxPoolGroupNorm(64, 128, 5, 1, 1, 8, 8)
    assert model.groups == 8 and model.conv_transpose.groups == 1
    assert model.conv_transpose.weight.shape == (64, 128, 5, 5)


@pytest.mark.parametrize("name", ["A", "B", "C"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_modules_match_kernelbench_cpu(name, dtype):
    init, shape = SMALL[name]
    ref, mine = make_pair(name, init, dtype=getattr(torch, dtype))
    tol = 1e-5 if dtype == "float32" else 1e-12
    gen = torch.Generator().manual_seed(3)
    for step in range(2):  # B: the second step sees the running buffers of the first
        x = torch.rand(shape, generator=gen, dtype=getattr(torch, dtype))
        with torch.no_grad():
            got, want = mine(x), ref(x)
        assert got.dtype == want.dtype
        assert rel_err(got.double().numpy(), want.double().numpy()) < tol, step
    for key, value in ref.state_dict().items():  # B's running statistics and batch count
        assert torch.allclose(mine.state_dict()[key], value, rtol=tol, atol=0), key


def test_module_b_eval_uses_running_statistics_cpu():
    init, shape = SMALL["B"]
    ref, mine = make_pair("B", init, dtype=torch.float64)
    with torch.no_grad():
        for model in (ref, mine):
            model.batch_norm.running_mean.uniform_(-0.5, 0.5)
            model.batch_norm.running_var.uniform_(0.5, 2.0)
        mine.load_state_dict(ref.state_dict())
        ref.eval()
        mine.eval()
        x = torch.rand(shape, dtype=torch.float64)
        got, want = mine(x), ref(x)
    assert rel_err(got.numpy(), want.numpy()) < 1e-12
    # Eval mode leaves the buffers alone.
    assert int(mine.batch_norm.num_batches_tracked) == 0
    assert torch.equal(mine.batch_norm.running_mean, ref.batch_norm.running_mean)


def test_forward_only_errors():
    init, shape = SMALL["A"]
    model = ours("A")(*init)
    x = torch.rand(shape)
    with pytest.raises(RuntimeError, match="forward-only.*torch.no_grad"):
        model(x)  # the parameters require grad
    with pytest.raises(RuntimeError, match="forward-only"):
        torch.ops.cufused.softmax(x.requires_grad_())
    with torch.no_grad():
        assert model(x).shape == (2, 8, 4, 4)
    with torch.inference_mode():
        assert model(x).shape == (2, 8, 4, 4)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="forward-only"):
        torch.compile(model, fullgraph=True, backend="aot_eager")(x)


# Inductor, except for B, whose BatchNorm bookkeeping (num_batches_tracked += 1) inductor
# compiles to C++ for tens of seconds on the CPU; aot_eager still functionalizes B's in-place
# update of the running statistics.
@pytest.mark.parametrize("name,backend", [("A", "inductor"), ("B", "aot_eager"),
                                          ("C", "inductor")])
def test_torch_compile_fullgraph_cpu(name, backend):
    init, shape = SMALL[name]
    _, mine = make_pair(name, init)
    _, eager = make_pair(name, init)
    x = torch.rand(shape)
    torch._dynamo.reset()
    compiled = torch.compile(mine, fullgraph=True, backend=backend)
    with torch.no_grad():
        for _ in range(2):
            got, want = compiled(x), eager(x)
            assert rel_err(got.numpy(), want.numpy()) < 1e-6
    for key, value in eager.state_dict().items():  # B: buffer updates happen when compiled
        assert torch.allclose(mine.state_dict()[key], value, rtol=1e-6, atol=0), key


@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_torch_export(name):
    init, shape = SMALL[name]
    _, mine = make_pair(name, init)
    _, eager = make_pair(name, init)
    x = torch.rand(shape)
    with torch.no_grad():
        program = torch.export.export(mine, (x,))
        ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
        assert any(op.startswith("cufused.") for op in ops), ops
        got, want = program.module()(x), eager(x)
    assert rel_err(got.numpy(), want.numpy()) < 1e-6


# -------------------------------------------------------------------------------- GPU tests


@pytest.fixture
def cuda():
    """PyTorch with CUDA, TF32 off (the reference side computes in float64 anyway)."""
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    allow = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = allow


@pytest.mark.gpu
def test_cupy_views_are_the_tensors_memory(cuda):
    import cupy

    base = torch.rand(4, 6, 10, 12, device="cuda")
    for t in (base, base.permute(0, 2, 3, 1), base[1:3, :, 2:, ::2], base[0, 0]):
        view = cft._cupy_view(t, cupy)
        ref = cupy.from_dlpack(t)  # what DLPack gives, for comparison
        assert view.data.ptr == t.data_ptr() == ref.data.ptr
        assert view.shape == ref.shape and view.strides == ref.strides
        assert bool((view == ref).all())


@pytest.mark.gpu
@pytest.mark.parametrize("name", OPS)
def test_opcheck_cuda(cuda, name):
    args, kwargs = samples("cuda")[name]
    torch.library.opcheck(getattr(torch.ops.cufused, name).default, args, kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("name", BLOCKS)
def test_building_blocks_match_torch_functional_cuda(cuda, name):
    check_building_block(name, "cuda", torch.float32, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", ["small", "canonical"])
@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_modules_match_kernelbench_cuda(cuda, name, sizes):
    # cufused's module in float32 ("ieee") against the KernelBench model in float64, two
    # training steps (B: its running statistics too), then B in eval mode.
    init, shape = (SMALL if sizes == "small" else CANONICAL)[name]
    ref, mine = make_pair(name, init, device="cuda")
    ref.double()
    gen = torch.Generator(device="cuda").manual_seed(5)
    with torch.no_grad():
        for step in range(2):
            x = torch.rand(shape, generator=gen, device="cuda")
            got, want = mine(x), ref(x.double())
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert rel_err(got.cpu().numpy(), want.cpu().numpy()) < 1e-4, step
        for key, value in ref.state_dict().items():
            err = rel_err(mine.state_dict()[key].cpu().numpy(), value.cpu().numpy())
            assert err < 1e-5, key
        if name == "B":
            ref.eval()
            mine.eval()
            got, want = mine(x), ref(x.double())
            assert rel_err(got.cpu().numpy(), want.cpu().numpy()) < 1e-4
    del ref, mine, got, want, x
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_operators_run_on_torch_current_stream(cuda):
    # On a side stream the input is written after a long spin; an operator that ran on any
    # other stream would read the zeros before the write.
    init, shape = SMALL["A"]
    _, mine = make_pair("A", init, device="cuda")
    values = torch.rand(shape, device="cuda")
    with torch.no_grad():
        want = mine(values)
        x = torch.zeros(shape, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # a few tens of ms of GPU spin
            x.copy_(values)
            got = mine(x)
        side.synchronize()
    assert rel_err(got.cpu().numpy(), want.cpu().numpy()) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("name,train", [("A", True), ("B", True), ("B", False), ("C", True)])
def test_modules_in_cuda_graph_capture(cuda, name, train):
    # PyTorch's recipe: warm up on a side stream, capture with torch.cuda.graph (its own
    # stream, global capture mode), replay on new input values.
    init, shape = SMALL[name]
    _, mine = make_pair(name, init, device="cuda")
    mine.train(train)
    static_x = torch.rand(shape, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        with torch.cuda.stream(side):
            for _ in range(3):
                mine(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = mine(static_x)
        for seed in range(2):
            new_x = torch.rand(shape, device="cuda", generator=torch.Generator(
                device="cuda").manual_seed(seed))
            static_x.copy_(new_x)
            static_y.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            want = mine(new_x)
            assert rel_err(static_y.cpu().numpy(), want.cpu().numpy()) < 1e-6, seed


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_torch_compile_fullgraph_cuda(cuda, name):
    init, shape = SMALL[name]
    _, mine = make_pair(name, init, device="cuda")
    _, eager = make_pair(name, init, device="cuda")
    x = torch.rand(shape, device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(mine, fullgraph=True)
    with torch.no_grad():
        for _ in range(2):
            got, want = compiled(x), eager(x)
            assert rel_err(got.cpu().numpy(), want.cpu().numpy()) < 1e-6
    for key, value in eager.state_dict().items():
        assert torch.allclose(mine.state_dict()[key], value, rtol=1e-6, atol=0), key


@pytest.mark.gpu
@pytest.mark.parametrize("name", PIPELINES)
def test_host_time_added_over_the_cupy_call(cuda, name):
    # Warm back-to-back calls without synchronizing, on small inputs (so that the host, not
    # the device, sets the pace): the operator may add at most 15 us of host time per call
    # over the same cufused call on CuPy arrays. Median of alternating rounds.
    import cupy

    import cufused

    args, kwargs = samples("cuda")[name]
    cargs = [cupy.from_dlpack(a) for a in args]
    ckwargs = {k: cupy.from_dlpack(v) if isinstance(v, torch.Tensor) else v
               for k, v in kwargs.items()}
    op = getattr(torch.ops.cufused, name).default
    fn = getattr(cufused, name)
    calls = {"cupy": lambda: fn(*cargs, **ckwargs), "torch": lambda: op(*args, **kwargs)}
    rounds, per_round = 30, 50
    times = {k: [] for k in calls}
    with torch.no_grad():
        for call in calls.values():
            for _ in range(20):
                call()
        for r in range(rounds):
            for key in (("cupy", "torch") if r % 2 else ("torch", "cupy")):
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(per_round):
                    calls[key]()
                times[key].append((time.perf_counter() - start) / per_round)
    torch.cuda.synchronize()
    cupy_us, torch_us = (float(np.median(times[k])) * 1e6 for k in ("cupy", "torch"))
    print(f"{name}: CuPy call {cupy_us:.1f} us, operator {torch_us:.1f} us, "
          f"added {torch_us - cupy_us:.1f} us")
    assert torch_us - cupy_us <= 15.0
