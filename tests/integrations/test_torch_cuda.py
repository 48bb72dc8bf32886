"""cufused.torch on a GPU: opcheck and the modules on CUDA tensors, the current stream,
CUDA-graph capture, torch.compile and the host time added over the CuPy call."""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import rel_err
from torch_cases import (BLOCKS, CANONICAL, OPS, PIPELINES, SMALL, cft, check_building_block,
                         make_pair, samples, torch)

pytestmark = pytest.mark.oracle


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
        view = cft._cupy_view(t, cupy, "x")
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
@pytest.mark.parametrize("name, args, kwargs", [
    ("conv2d", ((3, 9, 8), (4, 3, 3, 2)), dict(padding=[1, 0])),
    ("conv_transpose3d", ((2, 3, 4, 3), (2, 4, 3, 3, 3)), dict(stride=[2, 2, 2])),
    ("max_pool2d", ((3, 9, 8),), dict(kernel_size=[3, 3], stride=[2, 2])),
])
def test_block_operators_take_unbatched_input_cuda(cuda, name, args, kwargs):
    tensors = [torch.rand(*shape, device="cuda") for shape in args]
    op = getattr(torch.ops.cufused, name).default
    torch.library.opcheck(op, tuple(tensors), kwargs)
    want = getattr(torch.nn.functional, name)(*(t.double() for t in tensors), **kwargs)
    got = op(*tensors, **kwargs)
    assert got.shape == want.shape
    assert rel_err(got.double().cpu().numpy(), want.cpu().numpy()) < 1e-5


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
@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_modules_in_grad_mode_cuda(cuda, name):
    # As KernelBench times a model: calls in grad mode with the parameters requiring grad, a
    # synchronize after each. Each gives the no_grad call's result (B: its running statistics
    # updated once a call); the result requires grad and its backward raises.
    init, shape = SMALL[name]
    ref, mine = make_pair(name, init, device="cuda")
    x = torch.rand(shape, device="cuda")
    for _ in range(3):
        got = mine(x)
        torch.cuda.synchronize()
        with torch.no_grad():
            want = ref(x)
        assert got.requires_grad and got.grad_fn is not None
        assert rel_err(got.detach().cpu().numpy(), want.cpu().numpy()) < 1e-4
    for key, value in ref.state_dict().items():
        assert torch.allclose(mine.state_dict()[key], value, rtol=1e-5, atol=0), key
    with pytest.raises(NotImplementedError, match="forward-only"):
        got.sum().backward()


@pytest.mark.gpu
def test_bad_cuda_calls_raise_before_any_work(cuda):
    # The CUDA kernel's output shape comes before cufused's checks: where it cannot be formed
    # (a zero stride, a negative size) the shape's checks say why; otherwise cufused's own
    # checks do. A tensor of another device is refused, and nothing is written.
    x = torch.rand(2, 4, 6, 6, device="cuda")
    with pytest.raises(ValueError, match="stride must be >= 1"):
        torch.ops.cufused.max_pool2d(x, 2, 0)
    with pytest.raises(ValueError, match="spatial size"):
        torch.ops.cufused.max_pool2d(x, 9, 1)
    with pytest.raises(ValueError, match="kernel_size: .* larger than x"):
        torch.ops.cufused.max_pool2d(x, 7)  # an empty output: cufused's own check
    with pytest.raises(ValueError, match="weight is a tensor on cpu.*same device"):
        torch.ops.cufused.group_norm(x, 2, torch.ones(4))
    w = torch.rand(4, 3, 3, 3, device="cuda")
    with pytest.raises(TypeError, match="weight has dtype torch.bfloat16"):
        torch.ops.cufused.conv_transpose2d(x, w.bfloat16())
    with pytest.raises(ValueError, match="weight must have 4 dimensions"):
        torch.ops.cufused.conv_transpose2d(x, w[0, 0, 0])
    # A result past the device's memory: cufused's refusal, not the allocator's error.
    with pytest.raises(ValueError, match="the result would have shape"):
        torch.ops.cufused.conv_transpose2d(x, w, stride=[2**20])
    rm, rv = torch.zeros(4, device="cuda"), torch.ones(4, device="cuda")
    with pytest.raises(ValueError, match="momentum"):
        torch.ops.cufused.batch_norm(x, running_mean=rm, running_var=rv, momentum=float("inf"))
    assert not rm.any() and bool((rv == 1).all())


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
@pytest.mark.parametrize("name", PIPELINES + ["group_norm", "softmax"])
def test_warm_operator_calls_launch_from_their_raw_arguments(cuda, name, monkeypatch):
    # A loop that rebinds each result (y = op(x)): once the graphs are captured, a call
    # allocates its result and launches the graph cached for that buffer, without CuPy views
    # or checks; each result is a new tensor, and new input values reach it (equal to the
    # CuPy call on the same values).
    import cupy

    import cufused
    from cufused._settings import plan_options
    from cufused.torch import _kernels

    # Without the graphs of earlier tests: a key whose graph was dropped runs directly.
    cufused.clear_caches()
    args, kwargs = samples("cuda")[name]
    op = getattr(torch.ops.cufused, name).default
    gen = torch.Generator(device="cuda").manual_seed(3)
    inputs = [torch.rand(args[0].shape, generator=gen, device="cuda") for _ in range(3)]
    with torch.no_grad():
        y = op(*args, **kwargs)
        snapshots = [torch.full_like(y, float("nan")) for _ in inputs]
        for _ in range(12):
            y = op(*args, **kwargs)
        views = []
        view = _kernels._cupy_view
        monkeypatch.setattr(_kernels, "_cupy_view", lambda *a: views.append(1) or view(*a))
        for x, snapshot in zip(inputs, snapshots):
            args[0].copy_(x)
            previous = y
            y = op(*args, **kwargs)
            assert y.data_ptr() != previous.data_ptr()
            del previous
            snapshot.copy_(y)
        assert not views
    monkeypatch.undo()
    fn = getattr(cufused, name)
    for x, snapshot in zip(inputs, snapshots):
        args[0].copy_(x)
        with plan_options(replay=False):  # checked and run directly
            want = fn(*(cupy.from_dlpack(a) if isinstance(a, torch.Tensor) else a
                        for a in args),
                      **{k: cupy.from_dlpack(v) if isinstance(v, torch.Tensor) else v
                         for k, v in kwargs.items()})
        assert rel_err(snapshot.cpu().numpy(), cupy.asnumpy(want)) < 1e-5


@pytest.fixture(scope="module")
def noop_operators():
    """Operators with the pipelines' schemas whose CUDA kernel returns its first argument:
    PyTorch's own host time for a call with these arguments."""
    lib = torch.library.Library("cufused_test_noop", "DEF")
    for name in PIPELINES:
        lib.define(name + cft.OPERATORS[name][0])
        lib.impl(name, lambda *args, **kwargs: args[0], "CUDA")
    yield torch.ops.cufused_test_noop
    lib._destroy()


@pytest.mark.gpu
@pytest.mark.parametrize("name", PIPELINES)
def test_host_time_added_over_the_cupy_call(cuda, noop_operators, name):
    # Warm back-to-back calls without synchronizing, on small inputs (so that the host, not
    # the device, sets the pace), median of alternating rounds. The operator's host time less
    # PyTorch's own for these arguments (a no-op operator of the same schema) is its kernel:
    # a key from the tensors, PyTorch's allocation and the graph launch, the work the same
    # cufused call on CuPy arrays does. It may take at most 1.5 times that call; both scale
    # with the host's speed, which differs between machines of one kind.
    import cupy

    import cufused

    # Without the graphs of earlier tests: a key whose graph was dropped runs directly.
    cufused.clear_caches()
    args, kwargs = samples("cuda")[name]
    cargs = [cupy.from_dlpack(a) for a in args]
    ckwargs = {k: cupy.from_dlpack(v) if isinstance(v, torch.Tensor) else v
               for k, v in kwargs.items()}
    op = getattr(torch.ops.cufused, name).default
    noop = getattr(noop_operators, name).default
    fn = getattr(cufused, name)
    calls = {"cupy": lambda: fn(*cargs, **ckwargs), "torch": lambda: op(*args, **kwargs),
             "dispatch": lambda: noop(*args, **kwargs)}
    rounds, per_round = 30, 50
    times = {k: [] for k in calls}
    with torch.no_grad():
        for call in calls.values():
            for _ in range(20):
                call()
        for r in range(rounds):
            for key in list(calls)[r % 3:] + list(calls)[:r % 3]:
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(per_round):
                    calls[key]()
                times[key].append((time.perf_counter() - start) / per_round)
    torch.cuda.synchronize()
    cupy_us, torch_us, dispatch_us = (float(np.median(times[k])) * 1e6 for k in calls)
    print(f"{name}: CuPy call {cupy_us:.1f} us, operator {torch_us:.1f} us, PyTorch's "
          f"dispatch {dispatch_us:.1f} us")
    assert torch_us - dispatch_us <= 1.5 * cupy_us
