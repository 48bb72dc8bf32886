"""cufused.torch on the CPU: the custom operators (opcheck), the KernelBench modules against
the KernelBench reference models, torch.compile / torch.export, forward-only errors."""

from __future__ import annotations


import pytest

from conftest import rel_err
from torch_cases import (BLOCKS, OPS, SMALL, cft, check_building_block, kernelbench_models,
                         make_pair, ours, samples, torch)

pytestmark = pytest.mark.oracle


# -------------------------------------------------------------------------- CPU (CI) tests


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


@pytest.mark.parametrize("name,shape", [("max_pool2d", (2, 4, 7, 6)),
                                        ("avg_pool3d", (2, 3, 5, 6, 4))])
def test_pool_operators_take_one_element_lists(name, shape):
    # A one-element int[n] list stands for every spatial axis, in eager calls and in the fake
    # kernel that torch.compile and torch.export run.
    x = torch.rand(*shape, dtype=torch.float64)
    kwargs = dict(stride=[1], padding=[1]) if name == "avg_pool3d" else {}
    op = getattr(torch.ops.cufused, name).default
    torch.library.opcheck(op, (x, [2]), kwargs)
    nd = len(shape) - 2
    want = getattr(torch.nn.functional, name)(x, [2] * nd, **{k: v * nd for k, v in kwargs.items()})
    assert rel_err(op(x, [2], **kwargs).numpy(), want.numpy()) < 1e-12


@pytest.mark.parametrize("name, args, kwargs", [
    ("conv2d", ((3, 9, 8), (4, 3, 3, 2)), dict(padding=[1, 0])),
    ("conv_transpose3d", ((2, 3, 4, 3), (2, 4, 3, 3, 3)), dict(stride=[2, 2, 2])),
    ("max_pool2d", ((3, 9, 8),), dict(kernel_size=[3, 3], stride=[2, 2])),
    ("avg_pool3d", ((2, 5, 6, 4),), dict(kernel_size=[2, 2, 2])),
])
def test_block_operators_take_unbatched_input(name, args, kwargs):
    # Without the batch axis, as torch.nn.functional's: eagerly and in the fake kernel that
    # torch.compile and torch.export run.
    tensors = [torch.rand(*shape, dtype=torch.float64) for shape in args]
    op = getattr(torch.ops.cufused, name).default
    torch.library.opcheck(op, tuple(tensors), kwargs)
    want = getattr(torch.nn.functional, name)(*tensors, **kwargs)
    got = op(*tensors, **kwargs)
    assert got.shape == want.shape and rel_err(got.numpy(), want.numpy()) < 1e-12
    compiled = torch.compile(lambda *t: op(*t, **kwargs), fullgraph=True, backend="aot_eager")
    assert rel_err(compiled(*tensors).numpy(), want.numpy()) < 1e-12


@pytest.mark.parametrize("name, shape", [("conv2d", (3, 9)), ("max_pool3d", (1, 2, 3, 4, 5, 6))])
def test_fake_kernel_names_both_ranks_for_a_wrong_ndim(name, shape):
    # A traced call with x of neither rank fails as the eager call does, naming both ranks.
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = (torch.rand(4, 3, 3, 3),) if name == "conv2d" else ([2, 2, 2],)
    op = getattr(torch.ops.cufused, name).default
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(torch.rand(*shape))] + [
            mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        nd = 3 if name == "max_pool3d" else 2
        with pytest.raises(ValueError, match=rf"x must have {nd + 2} dimensions .* or "
                                             rf"{nd + 1} \(unbatched\)"):
            op(*fake)


def test_warm_call_key_tells_the_threads_per_thread_default_streams_apart(monkeypatch):
    # Handle 2 is each thread's own per-thread default stream: a warm call's key holds the
    # thread there (a graph captured for one thread's stream is not another's), and only there.
    import threading

    from cufused.torch import _kernels

    x = torch.rand(2, 3, 4, 4)
    for handle, same in ((2, False), (7, True)):
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: handle,
                            raising=False)
        keys = [_kernels._warm_key("max_pool2d", (x, [2, 2]), {}, 0)]
        thread = threading.Thread(
            target=lambda: keys.append(_kernels._warm_key("max_pool2d", (x, [2, 2]), {}, 0)))
        thread.start()
        thread.join()
        assert keys[0] is not None and keys[0][5] == keys[1][5] == handle
        assert (keys[0] == keys[1]) is same


@pytest.mark.parametrize("scale", [2.0, None])
def test_pipeline_scale_as_one_value_or_none(scale):
    # The function takes a number or None for scale; the operator a tensor of one value or None.
    import cufused

    x, w = torch.rand(2, 3, 10, 10, dtype=torch.float64), torch.randn(8, 3, 3, 3).double()
    kw = dict(num_groups=4, pool_kernel=2, clamp_min=-0.5, clamp_max=0.5)
    op = torch.ops.cufused.conv2d_groupnorm_scale_maxpool_clamp.default
    want = cufused.conv2d_groupnorm_scale_maxpool_clamp(x.numpy(), w.numpy(), None, None, None,
                                                        scale, **kw)
    for name in ("conv2d_groupnorm_scale_maxpool_clamp",
                 "conv_transpose3d_avgpool_clamp_softmax_multiply"):
        assert "Tensor? scale" in str(getattr(torch.ops.cufused, name).default._schema)
    for given in ([None] if scale is None else
                  [torch.tensor(scale, dtype=torch.float64), torch.tensor([scale]).double()]):
        torch.library.opcheck(op, (x, w, None, None, None, given), kw)
        assert rel_err(op(x, w, None, None, None, given, **kw).numpy(), want) < 1e-12


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


@pytest.mark.parametrize("model_training, bn_training", [(False, False), (True, False),
                                                        (False, True)])
def test_module_b_follows_its_batch_norm_layers_mode(model_training, bn_training):
    # Eval mode normalizes with the running statistics and leaves them alone. nn.BatchNorm2d
    # reads its own mode: model.train() then model.batch_norm.eval() freezes the statistics
    # (fine-tuning), and the reverse normalizes with the batch's.
    init, shape = SMALL["B"]
    ref, mine = make_pair("B", init, dtype=torch.float64)
    with torch.no_grad():
        for model in (ref, mine):
            model.batch_norm.running_mean.uniform_(-0.5, 0.5)
            model.batch_norm.running_var.uniform_(0.5, 2.0)
        mine.load_state_dict(ref.state_dict())
        for model in (ref, mine):
            model.train(model_training)
            model.batch_norm.train(bn_training)
        x = torch.rand(shape, dtype=torch.float64)
        got, want = mine(x), ref(x)
    assert rel_err(got.numpy(), want.numpy()) < 1e-12
    for key, value in ref.state_dict().items():
        assert torch.allclose(mine.state_dict()[key], value, rtol=1e-12, atol=0), key


def test_forward_only_errors():
    init, shape = SMALL["A"]
    model = ours("A")(*init)
    x = torch.rand(shape)
    with pytest.raises(RuntimeError, match="forward-only.*torch.no_grad"):
        torch.ops.cufused.softmax(x.clone().requires_grad_())
    with pytest.raises(RuntimeError, match="forward-only.*torch.no_grad"):
        torch.ops.cufused.conv2d_groupnorm_scale_maxpool_clamp(
            x, model.conv.weight, None, None, None, None, num_groups=4, pool_kernel=2,
            clamp_min=0.0, clamp_max=1.0)  # the weight requires grad
    with torch.no_grad():
        assert model(x).shape == (2, 8, 4, 4)
    with torch.inference_mode():
        assert model(x).shape == (2, 8, 4, 4)


@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_modules_in_grad_mode_trace_whole(name):
    # In grad mode a module compiles with fullgraph=True and exports, its result's backward
    # traced as an operator that raises where it runs.
    init, shape = SMALL[name]
    ref, mine = make_pair(name, init)
    x = torch.rand(shape)
    torch._dynamo.reset()
    got = torch.compile(mine, fullgraph=True, backend="aot_eager")(x)
    with torch.no_grad():
        want = ref(x)
    assert got.requires_grad and rel_err(got.detach().numpy(), want.numpy()) < 1e-5
    with pytest.raises(NotImplementedError, match="forward-only"):
        got.sum().backward()
    assert all(p.grad is None for p in mine.parameters())
    program = torch.export.export(mine.eval(), (x,))
    ops = {str(n.target) for n in program.graph_module.modules() if hasattr(n, "graph")
           for n in n.graph.nodes if n.op == "call_function"}
    assert any(op.startswith("cufused.") for op in ops), ops
    ref.eval()
    exported = program.module()(x)  # in grad mode: the operator without autograd
    assert not exported.requires_grad
    with torch.no_grad():
        assert rel_err(exported.numpy(), ref(x).numpy()) < 1e-5


@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_modules_in_grad_mode(name):
    # A module call in grad mode (parameters that require grad, as KernelBench times a model)
    # gives the no_grad result, once; the result requires grad and its backward raises.
    init, shape = SMALL[name]
    ref, mine = make_pair(name, init)
    x = torch.rand(shape)
    got = mine(x)
    with torch.no_grad():
        want = ref(x)
    assert got.requires_grad and got.grad_fn is not None
    assert rel_err(got.detach().numpy(), want.numpy()) < 1e-5
    for key, value in ref.state_dict().items():  # B's running statistics, counted once
        assert torch.allclose(mine.state_dict()[key], value, rtol=1e-5, atol=0), key
    with pytest.raises(NotImplementedError, match="forward-only"):
        got.sum().backward()
    assert all(p.grad is None for p in mine.parameters())
    # An input that requires grad alone also gives a result that does; nothing that requires
    # grad gives a plain result; and a model compiled without fullgraph runs the same way.
    mine.requires_grad_(False)
    assert mine(x.clone().requires_grad_()).requires_grad
    plain = mine(x)
    assert not plain.requires_grad and plain.grad_fn is None
    mine.requires_grad_(True)
    batches = [int(m.num_batches_tracked) for m in mine.modules()
               if isinstance(m, torch.nn.BatchNorm2d)]
    torch._dynamo.reset()
    compiled = torch.compile(mine, backend="aot_eager")(x)
    assert compiled.requires_grad
    with pytest.raises(NotImplementedError, match="forward-only"):
        compiled.sum().backward()
    assert [int(m.num_batches_tracked) for m in mine.modules()
            if isinstance(m, torch.nn.BatchNorm2d)] == [b + 1 for b in batches]
    # The tensors that decide grad mode's path are every parameter (a DataParallel replica
    # has no parameters() to walk).
    assert {id(p) for p in mine.parameters()} == {id(t) for t in mine._weights()
                                                  if t is not None}


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


@pytest.mark.parametrize("eps", [1e-5, 1e-3])
@pytest.mark.parametrize("training", [True, False])
def test_module_b_without_running_statistics_compiles_with_inductor(training, eps):
    # BatchNorm without running statistics: the fused call (or, with another eps than
    # GroupNorm's, the building blocks' batch_norm) gets stand-in buffers, since Inductor
    # fails on an optional mutable argument left None.
    init, shape = SMALL["B"]
    ref, mine = make_pair("B", init)
    for model in (ref, mine):
        model.batch_norm.track_running_stats = False
        model.batch_norm.running_mean = model.batch_norm.running_var = None
        model.batch_norm.eps = eps
        model.train(training)
    x = torch.rand(shape)
    torch._dynamo.reset()
    compiled = torch.compile(mine, fullgraph=True)
    with torch.no_grad():
        assert rel_err(compiled(x).numpy(), ref(x).numpy()) < 1e-5


def test_module_b_cumulative_momentum_under_compile():
    # momentum=None reads num_batches_tracked on the host: a compiled model runs that read
    # outside its graph, and fullgraph=True refuses it with the reason, as it refuses
    # nn.BatchNorm2d's; the update matches the eager module's either way.
    init, shape = SMALL["B"]
    ref, mine = make_pair("B", init)
    for model in (ref, mine):
        model.batch_norm.momentum = None
    x = torch.rand(shape)
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(torch._dynamo.exc.Unsupported,
                                        match="reads num_batches_tracked on the host"):
        torch.compile(mine, fullgraph=True, backend="aot_eager")(x)
    assert mine.batch_norm.num_batches_tracked.item() == 0
    torch._dynamo.reset()
    compiled = torch.compile(mine, backend="aot_eager")
    with torch.no_grad():
        for _ in range(2):
            assert rel_err(compiled(x).numpy(), ref(x).numpy()) < 1e-5
    for key, value in ref.state_dict().items():
        assert torch.allclose(mine.state_dict()[key], value, rtol=1e-5, atol=0), key


@pytest.mark.parametrize("name, path, replacement", [
    ("A", "conv", lambda: type("Conv2dSubclass", (torch.nn.Conv2d,), {})(3, 8, 3)),
    ("A", "group_norm", lambda: torch.nn.Identity()),
    ("A", "maxpool", lambda: torch.nn.AvgPool2d(4)),
    ("B", "conv_transpose", lambda: torch.nn.Conv2d(4, 8, 5)),
    ("B", "batch_norm", lambda: torch.nn.InstanceNorm2d(8)),
    ("B", "tanh", lambda: torch.nn.Identity()),
    ("B", "max_pool", lambda: torch.nn.AvgPool2d(2)),
    ("B", "group_norm", lambda: torch.nn.BatchNorm2d(8)),
    ("C", "avg_pool", lambda: torch.nn.MaxPool3d(2)),
    ("C", "conv_transpose",
     lambda: type("ConvTranspose3dSubclass", (torch.nn.ConvTranspose3d,), {})(3, 4, 3, 2, 1, 1)),
])
@pytest.mark.parametrize("training", [True, False])
def test_modules_refuse_a_submodule_of_another_class(name, path, replacement, training):
    # The fused call runs the operations of the classes the module was built with: a layer
    # swapped for another kind is refused, before any buffer changes.
    init, shape = SMALL[name]
    model = ours(name)(*init).train(training)
    setattr(model, path, replacement())  # a subclass, too, may change what forward computes
    before = [t.clone() for t in model.state_dict().values()]
    kind = type(getattr(model, path)).__qualname__
    with torch.no_grad(), pytest.raises(ValueError, match=rf"{path} must be a torch\.nn\.\w+, "
                                                          rf"as the fused pipeline computes, "
                                                          rf"got .*{kind}"):
        model(torch.rand(shape))
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))


@pytest.mark.parametrize("name, path", [("A", "conv"), ("B", "conv_transpose"),
                                        ("C", "conv_transpose")])
def test_modules_refuse_a_layer_with_forward_hooks(name, path):
    from torch.nn.utils import prune

    # Pruning computes a layer's weight in a forward pre-hook, which the fused call (reading
    # the parameters, not calling the layer) would skip: refused. A parametrized layer, whose
    # weight the parametrization computes on access, runs.
    init, shape = SMALL[name]
    ref, mine = make_pair(name, init)
    x = torch.rand(shape)
    with torch.no_grad():
        for model in (ref, mine):
            layer = torch.nn.utils.parametrizations.weight_norm(getattr(model, path))
            layer.parametrizations.weight.original0.mul_(2.0)  # the norm no longer the weight's
        assert rel_err(mine(x).numpy(), ref(x).numpy()) < 1e-5
        pruned = ours(name)(*init)
        prune.l1_unstructured(getattr(pruned, path), "weight", 0.5)
        with pytest.raises(ValueError, match=f"{path} has forward hooks"):
            pruned(x)


@pytest.mark.parametrize("name, shape", [("A", lambda c: (c,)), ("C", lambda c: (c, 1, 1)),
                                         ("C", lambda c: (1, c, 1, 1))])
def test_modules_refuse_a_scale_of_another_shape(name, shape):
    # A scale set after construction that x * scale would not align with the channels.
    init, x_shape = SMALL[name]
    model = ours(name)(*init)
    layer = model.conv if name == "A" else model.conv_transpose
    model.scale = torch.nn.Parameter(torch.ones(shape(layer.out_channels)))
    with torch.no_grad(), pytest.raises(ValueError, match=r"scale's shape must give each"):
        model(torch.rand(x_shape))


@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_modules_read_a_parametrized_weight_once(name):
    # spectral_norm's power iteration updates its vectors at each read of the weight: in
    # grad mode as without it, one read a call, as the KernelBench model's layer makes.
    init, shape = SMALL[name]
    ref, mine = make_pair(name, init)
    path = "conv" if name == "A" else "conv_transpose"
    for model in (ref, mine):
        torch.nn.utils.parametrizations.spectral_norm(getattr(model, path))
    mine.load_state_dict(ref.state_dict())
    x = torch.rand(shape)
    got = mine(x)
    with torch.no_grad():
        want = ref(x)
    assert got.requires_grad and rel_err(got.detach().numpy(), want.numpy()) < 1e-5
    vectors = [getattr(m, path).parametrizations.weight[0]._u for m in (mine, ref)]
    assert torch.equal(*vectors)


@pytest.mark.parametrize("name, path, setting, value", [
    ("A", "maxpool", "ceil_mode", True), ("B", "max_pool", "ceil_mode", True),
    ("C", "avg_pool", "ceil_mode", True), ("A", "conv", "groups", 2),
    ("B", "conv_transpose", "dilation", (2, 2))])
def test_modules_check_their_settings_before_reading_a_weight(name, path, setting, value):
    # A refused setting leaves a parametrized weight unread: spectral_norm's vectors, which
    # each read updates, stay as they were.
    init, shape = SMALL[name]
    model = ours(name)(*init)
    conv = "conv" if name == "A" else "conv_transpose"
    torch.nn.utils.parametrizations.spectral_norm(getattr(model, conv))
    setattr(getattr(model, path), setting, value)
    vector = getattr(model, conv).parametrizations.weight[0]._u.clone()
    with torch.no_grad(), pytest.raises(ValueError):
        model(torch.rand(shape))
    assert torch.equal(getattr(model, conv).parametrizations.weight[0]._u, vector)


def test_traced_call_names_the_tensor_on_another_device():
    with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=False) as mode:
        x = torch.empty(2, 4, 3, 3, device="meta")
        weight = mode.from_tensor(torch.ones(4))
        with pytest.raises(ValueError, match="weight is a tensor on cpu with x on meta"):
            torch.ops.cufused.group_norm(x, 2, weight)


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


def test_module_b_counts_a_batch_once_the_call_succeeds():
    # A call that fails (bad input, in grad mode or not) leaves the module as it was: with
    # momentum=None (a cumulative average) a miscounted batch would skew every later update.
    init, shape = SMALL["B"]
    ref, mine = make_pair("B", init, dtype=torch.float64)
    for model in (ref, mine):
        model.batch_norm.momentum = None
    x = torch.rand(shape, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"weight must have shape \(in_channels=1"):
        mine(x[:, :1])  # wrong input channels
    with torch.no_grad(), pytest.raises(ValueError, match=r"weight must have shape"):
        mine(x[:, :1])
    assert int(mine.batch_norm.num_batches_tracked) == 0
    with torch.no_grad():
        for _ in range(2):
            got, want = mine(x), ref(x)
    assert int(mine.batch_norm.num_batches_tracked) == 2
    assert rel_err(got.numpy(), want.numpy()) < 1e-12
    assert rel_err(mine.batch_norm.running_mean.numpy(),
                   ref.batch_norm.running_mean.numpy()) < 1e-12



@pytest.mark.parametrize("gn_eps", [1e-5, 1e-3])  # one fused call; the building blocks
@pytest.mark.parametrize("init, shape", [
    ([4, 6, 3, 1, 1, 1, 3], (2, 4, 1, 1)),  # a 1 x 1 convolution output: the pool refuses it
    ([4, 8, 5, 1, 1, 8, 8], (1, 4, 1, 1)),  # one value per GroupNorm group
])
def test_module_b_leaves_its_buffers_when_a_later_block_fails(gn_eps, init, shape):
    # With the norms' epsilons apart the blocks run one by one, and BatchNorm's, before the
    # pool and the GroupNorm, must not update the running statistics of a call that fails
    # (the KernelBench model updates them and then fails); as the fused call does.
    ref, mine = make_pair("B", init, dtype=torch.float64)
    for model in (ref, mine):
        model.batch_norm.momentum = None
        model.group_norm.eps = gn_eps
    bn = mine.batch_norm
    before = [t.clone() for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
    with torch.no_grad(), pytest.raises(ValueError, match="pool|more than 1 value per group"):
        mine(torch.rand(shape, dtype=torch.float64))
    after = (bn.running_mean, bn.running_var, bn.num_batches_tracked)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    x = torch.rand((2,) + shape[1:2] + (4, 4), dtype=torch.float64)
    with torch.no_grad():  # and a call that succeeds updates them as the model does
        got, want = mine(x), ref(x)
    assert int(bn.num_batches_tracked) == int(ref.batch_norm.num_batches_tracked) == 1
    assert rel_err(got.numpy(), want.numpy()) < 1e-12
    assert rel_err(bn.running_var.numpy(), ref.batch_norm.running_var.numpy()) < 1e-12


def test_modules_take_a_square_tuple_pool_window():
    init, shape = SMALL["A"]
    (in_c, out_c, k, groups, scale_shape, pool, lo, hi) = init
    square = ours("A")(in_c, out_c, k, groups, scale_shape, (pool, pool), lo, hi)
    plain = ours("A")(in_c, out_c, k, groups, scale_shape, pool, lo, hi)
    plain.load_state_dict(square.state_dict())
    x = torch.rand(shape)
    with torch.no_grad():
        assert torch.equal(square(x), plain(x))
    with pytest.raises(ValueError, match="maxpool_kernel_size must be an int or 2 equal sides"):
        ours("A")(in_c, out_c, k, groups, scale_shape, (pool, pool + 1), lo, hi)
    with pytest.raises(ValueError, match="pool_kernel_size must be an int or 3 equal sides"):
        ours("C")(2, 3, 3, 2, 1, 1, (2, 1, 2), 0.0, 1.0)


@pytest.mark.parametrize("name, path, value, message", [
    ("A", "conv.dilation", (2, 2), r"conv.dilation must be 1"),
    ("A", "conv.padding", (1, 0), r"conv.padding_mode must be 'zeros' where the conv"),
    ("A", "conv.groups", 3, r"conv.groups must be 1"),
    ("A", "maxpool.stride", 1, r"maxpool.stride must be 4"),
    ("A", "maxpool.padding", 1, r"maxpool.padding must be 0"),
    ("A", "maxpool.dilation", 2, r"maxpool.dilation must be 1"),
    ("A", "maxpool.ceil_mode", True, r"maxpool.ceil_mode must be False"),
    ("A", "maxpool.return_indices", True, r"maxpool.return_indices must be False"),
    ("B", "conv_transpose.dilation", (2, 2), r"conv_transpose.dilation must be 1"),
    ("B", "max_pool.stride", 1, r"max_pool.stride must be 2"),
    ("B", "max_pool.kernel_size", (2, 3), r"max_pool.kernel_size must be an int or 2 equal"),
    ("B", "max_pool.ceil_mode", True, r"max_pool.ceil_mode must be False"),
    ("B", "max_pool.padding", 1, r"max_pool.padding must be 0"),
    ("B", "max_pool.return_indices", True, r"max_pool.return_indices must be False"),
    ("B", "conv_transpose.padding_mode", "reflect", r"conv_transpose.padding_mode must be"),
    ("C", "conv_transpose.dilation", (1, 2, 1), r"conv_transpose.dilation must be 1"),
    ("C", "avg_pool.stride", 1, r"avg_pool.stride must be 2"),
    ("C", "avg_pool.padding", 1, r"avg_pool.padding must be 0"),
    ("C", "avg_pool.ceil_mode", True, r"avg_pool.ceil_mode must be False"),
    ("C", "avg_pool.divisor_override", 3, r"avg_pool.divisor_override must be None"),
    ("C", "avg_pool.kernel_size", (2, 1, 2), r"avg_pool.kernel_size must be an int or 3"),
    ("C", "conv_transpose.padding_mode", "reflect", r"conv_transpose.padding_mode must be"),
])
@pytest.mark.parametrize("training", [True, False])
def test_modules_refuse_submodule_settings_the_fused_call_lacks(name, path, value, message,
                                                                training):
    # A submodule setting either takes effect or is refused: the fused call has no option for
    # these, and PyTorch's forward of the same submodules would honour them.
    init, shape = SMALL[name]
    model = ours(name)(*init).train(training)
    if path == "conv.padding":  # a padding mode other than zeros, where the conv pads
        model.conv.padding_mode = "reflect"
    owner, attr = path.split(".")
    setattr(getattr(model, owner), attr, value)
    before = [t.clone() for t in model.state_dict().values()]
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        model(torch.rand(shape))
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))


@pytest.mark.parametrize("settings", [
    dict(conv=dict(padding="same")), dict(conv=dict(padding="valid")),
    dict(conv=dict(padding=(1, 2))), dict(conv=dict(padding=0, padding_mode="reflect")),
    dict(maxpool=dict(stride=None)), dict(maxpool=dict(stride=(4, 4), padding=(0, 0))),
    dict(group_norm=dict(eps=1e-2)), dict(conv=dict(stride=(2, 2))),
    dict(conv=dict(stride=(2, 1), padding=1), group_norm=dict(eps=1e-2)),
])
def test_module_a_takes_the_submodule_settings_the_fused_call_expresses(settings):
    init, shape = SMALL["A"]
    ref, mine = make_pair("A", init, dtype=torch.float64)
    for model in (ref, mine):
        for owner, values in settings.items():
            for attr, value in values.items():
                setattr(getattr(model, owner), attr, value)
    x = torch.rand(shape, dtype=torch.float64)
    with torch.no_grad():
        got, want = mine(x), ref(x)
    assert got.shape == want.shape
    assert rel_err(got.numpy(), want.numpy()) < 1e-12


@pytest.mark.parametrize("kernel_size", [(4, 4), (2, 3)])
def test_module_a_pads_an_even_kernel_same_as_pytorch(kernel_size):
    # padding="same" with an even kernel side: one zero more after the input than before it.
    init, shape = SMALL["A"]
    init = [*init[:2], kernel_size, *init[3:]]
    ref, mine = make_pair("A", init, dtype=torch.float64)
    for model in (ref, mine):
        model.conv.padding = "same"
    x = torch.rand(shape, dtype=torch.float64)
    with torch.no_grad():
        got, want = mine(x), ref(x)
    assert got.shape == want.shape == (shape[0], init[1], shape[2] // 4, shape[3] // 4)
    assert rel_err(got.numpy(), want.numpy()) < 1e-12


def test_pytorch_streams_reach_cupy_through_the_stream_protocol():
    import warnings

    cupy = pytest.importorskip("cupy")
    from cufused.torch import _kernels

    key = (0x1234, 0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # CuPy 14 deprecates ExternalStream
            stream = _kernels._current_stream(0, cupy, raw=key[0])
        assert isinstance(stream, cupy.cuda.Stream) and stream.ptr == key[0]
        assert _kernels._current_stream(0, cupy, raw=key[0]) is stream  # cached
    finally:
        _kernels._STREAMS.pop(key, None)  # a foreign stream: dropped, not destroyed


@pytest.mark.parametrize("training", [True, False])
def test_module_b_pools_with_its_max_pool_window(training):
    # The window is the max_pool submodule's, in the fused call and in the building blocks.
    init, shape = SMALL["B"]
    ref, mine = make_pair("B", init, dtype=torch.float64)
    for model in (ref, mine):
        model.max_pool = torch.nn.MaxPool2d(3)
        model.train(training)
    x = torch.rand(shape, dtype=torch.float64)
    with torch.no_grad():
        got, want = mine(x), ref(x)
    assert got.shape == want.shape == (shape[0], init[1], 3, 3)
    assert rel_err(got.numpy(), want.numpy()) < 1e-12


# Module B's routes, (training, group_norm.eps): in training with the norms' epsilons equal one
# fused call runs; with them apart, and in eval mode, the building blocks.
_B_ROUTES = [(True, 1e-5), (True, 1e-3), (False, 1e-5)]


def _b_pair(init, training, gn_eps, layer=None):
    """Module B and its reference in float64, in ``training`` mode with ``gn_eps``, random
    running statistics (the same in both) and, where given, ``layer`` (a copy in each) as
    ``conv_transpose``."""
    import copy

    ref, mine = make_pair("B", init, dtype=torch.float64)
    if layer is not None:
        ref.conv_transpose = copy.deepcopy(layer).double()
        mine.conv_transpose = copy.deepcopy(layer).double()
    with torch.no_grad():
        ref.batch_norm.running_mean.uniform_(-0.5, 0.5)
        ref.batch_norm.running_var.uniform_(0.5, 2.0)
    mine.load_state_dict(ref.state_dict())
    for model in (ref, mine):
        model.group_norm.eps = gn_eps
        model.train(training)
    return ref, mine


@pytest.mark.parametrize("training, gn_eps", _B_ROUTES)
def test_module_b_takes_its_conv_transposes_stride_and_output_padding(training, gn_eps):
    # Each route convolves with the layer's stride and output_padding (set after construction:
    # the KernelBench model has no argument for it). A 3 x 3 kernel at stride 2 gives an even
    # size only with the extra row and column, so the pooled shape shows them, in eval mode too.
    ref, mine = _b_pair([4, 8, 3, 2, 1, 1, 2], training, gn_eps)
    for model in (ref, mine):
        model.conv_transpose.output_padding = (1, 1)
    x = torch.rand(3, 4, 7, 9, dtype=torch.float64)
    with torch.no_grad():
        got, want = mine(x), ref(x)
    assert got.shape == want.shape == (3, 8, 7, 9)
    assert rel_err(got.numpy(), want.numpy()) < 1e-12
    for key, value in ref.state_dict().items():
        assert torch.allclose(mine.state_dict()[key], value, rtol=1e-12, atol=0), key


@pytest.mark.parametrize("gn_eps", [1e-5, 1e-3])  # one fused call; the building blocks
def test_module_b_cumulative_momentum_over_different_batches(gn_eps):
    # momentum=None weighs the batch counted n-th (from 0) by 1 / (n + 1), so the running
    # statistics are the plain mean of the batches'. A batch of another scale each step tells
    # those weights apart, which repeating one batch cannot (every average of it is itself).
    init, shape = SMALL["B"]
    ref, mine = _b_pair(init, True, gn_eps)
    for model in (ref, mine):
        model.batch_norm.momentum = None
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        x = torch.rand(shape, generator=gen, dtype=torch.float64) * (step + 1)
        with torch.no_grad():
            got, want = mine(x), ref(x)
        assert rel_err(got.numpy(), want.numpy()) < 1e-12, step
        bn, ref_bn = mine.batch_norm, ref.batch_norm
        assert int(bn.num_batches_tracked) == int(ref_bn.num_batches_tracked) == step + 1
        for key in ("running_mean", "running_var"):
            assert rel_err(getattr(bn, key).numpy(), getattr(ref_bn, key).numpy()) < 1e-12, \
                (step, key)


@pytest.mark.parametrize("training, gn_eps", _B_ROUTES)
def test_module_b_with_untracked_running_statistics_kept(training, gn_eps):
    # track_running_stats=False set after construction keeps the buffers: nn.BatchNorm2d then
    # normalizes a training batch with its own statistics and leaves the buffers (and the
    # batch count) alone; in eval mode it normalizes with the buffers.
    init, shape = SMALL["B"]
    ref, mine = _b_pair(init, training, gn_eps)
    for model in (ref, mine):
        model.batch_norm.track_running_stats = False
    before = {key: value.clone() for key, value in ref.state_dict().items()}
    x = torch.rand(shape, dtype=torch.float64)
    with torch.no_grad():
        got, want = mine(x), ref(x)
    assert rel_err(got.numpy(), want.numpy()) < 1e-12
    for key, value in before.items():
        assert torch.equal(ref.state_dict()[key], value), key
        assert torch.equal(mine.state_dict()[key], value), key


def test_module_c_clamps_with_its_own_bounds():
    # Bounds on either side of zero, and an input of both signs wide enough that the
    # convolution's output crosses each bound, so that the result depends on both.
    init = [3, 4, 3, 2, 1, 1, 2, -0.3, 0.4]
    ref, mine = make_pair("C", init, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    x = 16 * (torch.rand(SMALL["C"][1], generator=gen, dtype=torch.float64) - 0.5)
    with torch.no_grad():
        got, want = mine(x), ref(x)
        convolved = ref.conv_transpose(ref.avg_pool(x))
    assert (convolved < -0.3).any() and (convolved > 0.4).any()
    assert rel_err(got.numpy(), want.numpy()) < 1e-12


@pytest.mark.parametrize("name", BLOCKS)
def test_empty_batch_results_are_contiguous_as_the_fake_kernels(name):
    # An empty batch's result has the strides of a contiguous tensor of its shape, as the
    # fake kernel's and torch.nn.functional's have.
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, kwargs = samples("cpu", torch.float32)[name]
    args = (args[0][:0],) + tuple(args[1:])
    got = getattr(torch.ops.cufused, name)(*args, **kwargs)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = getattr(torch.ops.cufused, name)(*args, **kwargs)
    assert got.shape == fake.shape and got.shape[0] == 0
    assert got.stride() == fake.stride() == torch.empty(got.shape).stride()


@pytest.mark.parametrize("name", ["A", "C"])
@pytest.mark.parametrize("bounds", [(None, 0.4), (-0.3, None)])
def test_modules_take_a_none_clamp_bound_as_torch_clamp(name, bounds):
    # A None bound is no bound on that side, as torch.clamp takes it in the reference model;
    # the operator's schema takes None too.
    init = SMALL[name][0][:-2] + list(bounds)
    ref, mine = make_pair(name, init, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    x = 16 * (torch.rand(SMALL[name][1], generator=gen, dtype=torch.float64) - 0.5)
    both = make_pair(name, SMALL[name][0][:-2] + [-0.3, 0.4], dtype=torch.float64)[1]
    with torch.no_grad():
        got, want, clamped_both = mine(x), ref(x), both(x)
    assert (mine.clamp_min, mine.clamp_max) == bounds
    assert rel_err(got.numpy(), want.numpy()) < 1e-12
    assert rel_err(clamped_both.numpy(), want.numpy()) > 1e-3  # the absent bound matters


@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_modules_check_bounds_and_precision_when_built(name):
    # As torch.nn modules check their options: a bad value fails at construction, naming it.
    init = SMALL[name][0]
    with pytest.raises(ValueError, match="precision must be one of"):
        ours(name)(*init, precision="fp16")
    if name != "B":
        # A 0-d tensor and a 0-d array, as float() takes them.
        module = ours(name)(*init[:-2], torch.tensor(-0.5), torch.tensor([2.0])[0].numpy())
        assert (module.clamp_min, module.clamp_max) == (-0.5, 2.0)
        with pytest.raises(TypeError, match="clamp_min must be a real number"):
            ours(name)(*init[:-2], "low", 1.0)
        with pytest.raises(TypeError, match="clamp_max must be a real number"):
            ours(name)(*init[:-2], 0.0, torch.tensor([1.0, 2.0]))
        with pytest.raises(ValueError, match="clamp_max must not be NaN"):
            ours(name)(*init[:-2], 0.0, float("nan"))


def test_modules_outside_compiled_graphs_on_pytorch_without_a_reason(monkeypatch):
    # PyTorch before 2.8 has torch.compiler.disable(fn=None, recursive=True), no reason.
    from cufused.torch import _modules

    calls = []
    monkeypatch.setattr(torch.compiler, "disable",
                        lambda fn=None, recursive=True: calls.append(fn) or (lambda f: f))
    assert _modules._outside_compiled_graphs("why")(len)("ab") == 2 and calls == [None]


@pytest.mark.parametrize("name, training, gn_eps", [
    *(("B", training, gn_eps) for training, gn_eps in _B_ROUTES), ("C", True, None)])
def test_modules_take_a_grouped_conv_transpose(name, training, gn_eps):
    # A grouped layer installed in place of the KernelBench one (whose constructor makes it
    # ungrouped): the fused call, and B's building blocks, convolve with its groups.
    if name == "B":
        layer = torch.nn.ConvTranspose2d(4, 8, 5, stride=1, padding=1, groups=2)
        ref, mine = _b_pair([4, 8, 5, 1, 1, 1, 2], training, gn_eps, layer)
        x = torch.rand(3, 4, 7, 9, dtype=torch.float64)
    else:
        ref, mine = make_pair("C", [4, 6, 3, 2, 1, 1, 2, -0.3, 0.4], dtype=torch.float64)
        ref.conv_transpose = torch.nn.ConvTranspose3d(4, 6, 3, 2, 1, 1, groups=2).double()
        mine.conv_transpose = torch.nn.ConvTranspose3d(4, 6, 3, 2, 1, 1, groups=2).double()
        mine.load_state_dict(ref.state_dict())
        x = torch.rand(2, 4, 6, 5, 7, dtype=torch.float64)
    assert mine.conv_transpose.groups == 2
    with torch.no_grad():
        got, want = mine(x), ref(x)
    assert rel_err(got.numpy(), want.numpy()) < 1e-12
    for key, value in ref.state_dict().items():  # B's running statistics
        assert torch.allclose(mine.state_dict()[key], value, rtol=1e-12, atol=0), key


@pytest.mark.parametrize("scale_shape", [(6, 1, 1), (1, 6, 1, 1), (), (1,), 1, (1, 1, 1, 1)])
def test_module_a_scales_each_channel_as_x_times_scale(scale_shape):
    model = ours("A")(3, 6, 3, 2, scale_shape, 2, -1.0, 1.0).double()
    reference = kernelbench_models()["A"](3, 6, 3, 2, scale_shape, 2, -1.0, 1.0).double()
    with torch.no_grad():
        model.scale.copy_(torch.linspace(-2, 2, model.scale.numel()).reshape(scale_shape))
    reference.load_state_dict(model.state_dict())
    x = torch.rand(2, 3, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))


@pytest.mark.parametrize("scale_shape", [(6,), (6, 1), (1, 1, 6, 1, 1), (2, 6, 1, 1), (1, 1, 6)])
def test_module_a_refuses_a_scale_that_is_not_per_channel(scale_shape):
    # x * scale with a (6,) scale scales the width in PyTorch (here the 6 x 6 conv output of
    # an 8 x 8 input): the fused pipeline scales channels.
    with pytest.raises(ValueError, match="scale_shape must give each of the 6 output channels"):
        ours("A")(3, 6, 3, 2, scale_shape, 2, -1.0, 1.0)


def test_operators_name_bad_dtypes_devices_and_options():
    x = torch.rand(2, 4, 6, 6)
    with pytest.raises(TypeError, match="x has dtype torch.bfloat16"):
        torch.ops.cufused.max_pool2d(x.bfloat16(), 2)
    with pytest.raises(TypeError, match="weight has dtype torch.bfloat16"):
        torch.ops.cufused.group_norm(x, 2, torch.ones(4, dtype=torch.bfloat16))
    # A meta tensor among the arguments picks the fake kernel, which checks the devices.
    with pytest.raises(ValueError, match="on meta with x on cpu"):
        torch.ops.cufused.group_norm(x, 2, torch.ones(4, device="meta"))
    meta = x.to("meta")
    with pytest.raises(ValueError, match="stride must be >= 1"):
        torch.ops.cufused.max_pool2d(meta, 2, 0)
    with pytest.raises(ValueError, match="spatial size"):
        torch.ops.cufused.max_pool2d(meta, 7)
    with pytest.raises(ValueError, match="x has 4 channels but weight"):
        torch.ops.cufused.conv2d(meta, torch.ones(8, 3, 3, 3, device="meta"))
    assert torch.ops.cufused.conv2d(meta, torch.ones(8, 4, 3, 3, device="meta")).shape == (
        2, 8, 4, 4)


@pytest.mark.parametrize("channels", [4, 2**20 + 4])
def test_fake_kernel_takes_running_buffers_of_any_size(channels):
    # The fake kernel's stand-ins keep a running buffer contiguous and writeable at any size,
    # so that a traced call passes where the eager one does, and fails where it fails.
    x = torch.empty(2, channels, 2, device="meta")
    running = [torch.zeros(channels, device="meta"), torch.ones(channels, device="meta")]
    y = torch.ops.cufused.batch_norm(x, running_mean=running[0], running_var=running[1])
    assert y.shape == x.shape
    strided = torch.zeros(2 * channels, device="meta")[::2]
    with pytest.raises(ValueError, match="running_mean must be contiguous"):
        torch.ops.cufused.batch_norm(x, running_mean=strided, running_var=running[1])


class _Meta(tuple):
    """The shape of a meta tensor that the test creates (collection needs no PyTorch)."""


def _meta(*shape):
    return _Meta(shape)


# Calls the eager operators refuse, each with the ValueError or TypeError naming the argument
# that the traced (fake) call must raise too, before indexing a shape.
_REFUSED_BY_SHAPE = [
    ("conv2d", (_meta(2, 4, 8, 8), _meta(6)), {}, ValueError, "weight must have 4 dim"),
    ("conv2d", (_meta(2, 4, 8, 8), _meta(6, 4, 3)), {}, ValueError, "weight must have 4 dim"),
    ("conv3d", (_meta(4, 8, 8), _meta(6, 4, 3, 3)), {}, ValueError, "x must have 5 dim"),
    ("conv_transpose2d", (_meta(2, 4, 8, 8), _meta(4)), {}, ValueError,
     "weight must have 4 dim"),
    ("conv2d", (_meta(2, 4, 8, 8), _meta(6, 4, 3, 3)), dict(stride=[]), ValueError,
     "stride must be an int or a sequence of 2 ints"),
    ("conv2d", (_meta(2, 4, 8, 8), _meta(6, 4, 3, 3)), dict(stride=[1, 1, 1]), ValueError,
     "stride must be an int or a sequence of 2 ints"),
    ("conv2d", (_meta(2, 4, 8, 8), _meta(6, 4, 3, 3)), dict(groups=0), ValueError,
     "groups must be >= 1"),
    ("max_pool2d", (_meta(2, 4, 8, 8), []), {}, ValueError, "kernel_size must be an int"),
    ("max_pool2d", (_meta(2, 4, 8, 8), [3], [1], [2]), {}, ValueError,
     "padding must be at most half"),
    ("avg_pool3d", (_meta(1, 2, 4, 9, 9), [5]), dict(padding=[2]), ValueError,
     "kernel_size: pooling window .* larger than x"),
    ("conv2d_groupnorm_scale_maxpool_clamp",
     (_meta(2, 3, 10, 10), _meta(8), None, None, None, None),
     dict(num_groups=4, pool_kernel=2, clamp_min=0.0, clamp_max=1.0), ValueError,
     "weight must have 4 dim"),
    # Beyond the shape: the option rules that cufused's own checks apply.
    ("conv_transpose2d", (_meta(2, 3, 8, 8), _meta(3, 4, 3, 3)), dict(output_padding=[1]),
     ValueError, "output_padding must be smaller than stride or dilation"),
    ("conv2d", (_meta(2, 4, 8, 8), _meta(6, 4, 3, 3)), dict(precision="fp8"), ValueError,
     "precision must be one of"),
    ("group_norm", (_meta(2, 3, 8, 8), 2), {}, ValueError, "num_groups=2 must be positive"),
    ("group_norm", (_meta(2, 4, 0, 8), 2), {}, ValueError, "zero-sized non-batch dimension"),
    ("softmax", (_meta(2, 3, 8, 8), [7]), {}, ValueError, "axis 7 is out of bounds"),
    ("softmax", (_meta(2, 3, 8, 8), [1, -3]), {}, ValueError, "repeated"),
    ("softmax", (_meta(), []), {}, ValueError, "at least one dimension"),
    ("batch_norm", (_meta(2, 3, 8, 8),), dict(activation="relu"), ValueError, "activation"),
    ("batch_norm", (_meta(1, 3, 1, 1),), {}, ValueError, "more than 1 value per channel"),
    ("batch_norm", (_meta(2, 3, 8, 8),), dict(eps=0.0), ValueError, "eps must be > 0"),
    ("conv_transpose2d_batchnorm_tanh_maxpool_groupnorm",
     (_meta(2, 4, 6, 6), _meta(4, 8, 3, 3), None, None, None, None),
     dict(num_groups=3), ValueError, "num_groups=3 must be positive"),
    ("conv2d_groupnorm_scale_maxpool_clamp",
     (_meta(2, 3, 10, 10), _meta(8, 3, 3, 3), None, None, None, None),
     dict(num_groups=4, pool_kernel=2, clamp_min=0.0, clamp_max=1.0, method="fast"),
     ValueError, "method"),
]


@pytest.mark.parametrize("name, args, kwargs, error, message", _REFUSED_BY_SHAPE)
def test_traced_calls_refuse_what_eager_calls_refuse(name, args, kwargs, error, message):
    op = getattr(torch.ops.cufused, name)
    with pytest.raises(error, match=message):
        op(*[torch.empty(a, device="meta") if isinstance(a, _Meta) else a for a in args],
           **kwargs)
    cpu = [torch.rand(a) if isinstance(a, _Meta) else a for a in args]
    with pytest.raises((ValueError, TypeError)):  # the eager call's own check
        op(*cpu, **kwargs)


def test_traced_calls_refuse_the_dtypes_eager_calls_refuse():
    x = torch.empty(2, 4, 8, 8, device="meta")
    with pytest.raises(TypeError, match="x has dtype torch.bfloat16"):
        torch.ops.cufused.max_pool2d(x.bfloat16(), [2])
    with pytest.raises(TypeError, match="weight has dtype torch.int32"):
        torch.ops.cufused.conv2d(x, torch.empty(6, 4, 3, 3, device="meta", dtype=torch.int32))
    assert torch.ops.cufused.max_pool2d(x.half(), [2]).dtype == torch.float16


def test_traced_checks_hold_no_memory_of_the_tensors_size():
    # A weight of 36 GiB (meta): its stand-in repeats one zero; x is an empty batch.
    x = torch.empty(2, 16384, 64, 64, device="meta")
    w = torch.empty(65536, 16384, 3, 3, device="meta")
    assert torch.ops.cufused.conv2d(x, w).shape == (2, 65536, 62, 62)


def test_traced_cuda_calls_follow_the_gpu_rules(monkeypatch):
    # Fake CUDA tensors (no device needed): float32 only, and the host's memory is no limit
    # (a sample of 6.4 GiB in float32, past this test's host limit below).
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cufused import _arrays

    with FakeTensorMode():
        x = torch.empty(2, 4, 8, 8, device="cuda")
        with pytest.raises(TypeError, match="x has dtype torch.float16; supported here: float32"):
            torch.ops.cufused.max_pool2d(x.half(), [2])
        with pytest.raises(TypeError, match="running_var has dtype torch.float64"):
            torch.ops.cufused.batch_norm(x, running_mean=torch.zeros(4, device="cuda"),
                                         running_var=torch.ones(4, device="cuda").double())
        y = torch.ops.cufused.batch_norm(x, running_mean=torch.zeros(4, device="cuda"),
                                         running_var=torch.ones(4, device="cuda"))
        assert y.shape == x.shape and y.device.type == "cuda"
        monkeypatch.setattr(_arrays, "_memory_limit", lambda xp: 2**30)
        big = torch.empty(1, 1, 40000, 40000, device="cuda")
        assert torch.ops.cufused.max_pool2d(big, [2]).shape == (1, 1, 20000, 20000)
        with pytest.raises(ValueError, match="more than this machine's memory"):
            torch.ops.cufused.max_pool2d(torch.empty(1, 1, 40000, 40000), [2])


def test_export_refuses_a_call_its_program_could_not_run():
    class TransposedConv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 4, 3, 3))

        def forward(self, x):
            return torch.ops.cufused.conv_transpose2d(x, self.w, output_padding=[1])

    with torch.no_grad(), pytest.raises(ValueError, match="output_padding must be smaller"):
        torch.export.export(TransposedConv(), (torch.rand(2, 3, 8, 8),))


def test_cuda_kernel_output_shape_fails_with_the_checks(monkeypatch):
    # The CUDA kernel computes the output's shape before cufused checks the call; where that
    # computation fails (a zero stride, a negative size) the shape's checks say why. Both are
    # reached before any CuPy work, so a stand-in module serves here.
    from cufused.torch import _kernels

    monkeypatch.setattr(_kernels, "_CUPY", object())
    pool = _kernels._cuda_kernel("max_pool2d", cft.OPERATORS["max_pool2d"][1])
    x = torch.rand(2, 4, 6, 6)
    with pytest.raises(ValueError, match="stride must be >= 1"):
        pool(x, [2, 2], [0, 0], [0, 0])
    with pytest.raises(ValueError, match="spatial size"):
        pool(x, [9, 9], [1, 1], [0, 0])
    with pytest.raises(ValueError, match="kernel_size must be an int"):
        pool(x, [], [1, 1], [0, 0])
    conv = _kernels._cuda_kernel("conv2d", cft.OPERATORS["conv2d"][1])
    with pytest.raises(ValueError, match="weight must have 4 dimensions"):
        conv(x, torch.rand(6))


