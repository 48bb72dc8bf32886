"""Bad input gets a TypeError / ValueError that names the argument, before any work."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

import cufused

X4 = np.ones((2, 4, 8, 8), dtype=np.float32)
X5 = np.ones((1, 2, 4, 4, 4), dtype=np.float32)
W = np.ones((8, 4, 3, 3), dtype=np.float32)
C8 = np.ones(8, dtype=np.float32)

A_OPTS = dict(num_groups=2, pool_kernel=2, clamp_min=0.0, clamp_max=1.0)


def pipeline_a(**changes):
    args = dict(x=X4, weight=W, conv_bias=None, gn_weight=C8, gn_bias=None, scale=C8)
    opts = dict(A_OPTS)
    for k, v in changes.items():
        (args if k in args else opts)[k] = v
    return cufused.conv2d_groupnorm_scale_maxpool_clamp(*args.values(), **opts)


CASES = [
    # (callable, exception, message fragment)
    (lambda: cufused.conv2d(X4, W, stride=0), ValueError, "stride"),
    (lambda: cufused.conv2d(X4, W, padding=-1), ValueError, "padding"),
    (lambda: cufused.conv2d(X4, W, dilation=(1, 1, 1)), ValueError, "dilation"),
    (lambda: cufused.conv2d(X4, W, dilation=(1, 1.0)), TypeError, "dilation"),
    (lambda: cufused.conv2d(X4, W, groups=3), ValueError, "groups"),
    (lambda: cufused.conv2d(X4, W, groups=0), ValueError, "groups"),
    (lambda: cufused.conv2d(X4, np.ones((8, 3, 3, 3), np.float32)), ValueError, "weight"),
    (lambda: cufused.conv2d(X4, np.ones((8, 4, 3), np.float32)), ValueError, "weight"),
    (lambda: cufused.conv2d(X4[0, 0], W), ValueError, "x must be NCHW"),
    (lambda: cufused.conv2d(X4, np.ones((8, 4, 9, 9), np.float32)), ValueError, "empty"),
    (lambda: cufused.conv2d(X4, W, np.ones(7, np.float32)), ValueError, "bias"),
    (lambda: cufused.conv2d(X4.astype(np.int32), W), TypeError, "x has dtype int32"),
    (lambda: cufused.conv2d([[1.0]], W), TypeError, "x must be a numpy.ndarray"),
    (lambda: cufused.conv2d(X4, W, precision="fp16"), ValueError, "precision"),
    (lambda: cufused.conv2d(X4, W, out=np.empty((2, 8, 6, 5), np.float32)), ValueError, "out"),
    (lambda: cufused.conv2d(X4, W, out=np.empty((2, 8, 6, 6), np.float64)), ValueError, "out"),
    (lambda: cufused.conv2d(np.ones((2, 4, 0, 8), np.float32), W), ValueError, "zero-sized"),
    (lambda: cufused.conv3d(X4[0], W), ValueError, "NCDHW"),
    (lambda: cufused.conv_transpose2d(X4, W), ValueError, "in_channels=4"),
    (lambda: cufused.conv_transpose2d(X4, np.ones((4, 2, 3, 3), np.float32), output_padding=1),
     ValueError, "output_padding"),
    (lambda: cufused._ops._conv_args.check_conv_args(
        (1, 4, 8, 8), (8, 4, 3, 3), 2, transposed=False, stride=1, padding=0,
        output_padding=1), ValueError, "output_padding"),
    (lambda: cufused.conv_transpose3d(X5, np.ones((3, 2, 3, 3, 3), np.float32)), ValueError,
     "weight"),
    (lambda: cufused.group_norm(X4, 3), ValueError, "num_groups"),
    (lambda: cufused.group_norm(X4, 2.0), TypeError, "num_groups"),
    (lambda: cufused.group_norm(X4, 2, np.ones(3, np.float32)), ValueError, "weight"),
    (lambda: cufused.group_norm(X4, 2, eps=float("nan")), ValueError, "eps"),
    (lambda: cufused.group_norm(X4, 2, eps=-1.0), ValueError, "eps"),
    (lambda: cufused.group_norm(np.ones(4, np.float32), 2), ValueError, "at least 2"),
    (lambda: cufused.batch_norm(X4, momentum=float("nan")), ValueError, "momentum"),
    (lambda: cufused.batch_norm(X4, momentum="a"), TypeError, "momentum"),
    (lambda: cufused.batch_norm(X4, activation="relu"), ValueError, "activation"),
    (lambda: cufused.batch_norm(X4, training=False), ValueError, "running_mean"),
    (lambda: cufused.batch_norm(np.ones((1, 3), np.float32)), ValueError, "more than 1 value"),
    (lambda: cufused.batch_norm(X4, running_mean=np.zeros(3, np.float32)), ValueError,
     "running_mean"),
    (lambda: cufused.batch_norm(X4, running_var=np.ones((4, 2), np.float32)[:, 0]), ValueError,
     "running_var"),
    (lambda: cufused.max_pool2d(X4, 0), ValueError, "kernel_size"),
    (lambda: cufused.max_pool2d(X4, 9), ValueError, r"kernel_size: .* larger than x \("),
    (lambda: cufused.max_pool2d(X4, 11, padding=1), ValueError,
     r"kernel_size: .* larger than the padded x \(padding \(1, 1\)"),
    (lambda: cufused.max_pool2d(X4, 2, padding=2), ValueError, "padding"),
    (lambda: cufused.avg_pool3d(X4[0], 2), ValueError, "NCDHW"),
    (lambda: cufused.max_pool2d(X4[0], 2, out=np.empty((1, 4, 4, 4), np.float32)), ValueError,
     "out must have the unbatched result's ndim 3"),
    (lambda: cufused.avg_pool2d(X4, 2, stride=(1, 0)), ValueError, "stride"),
    (lambda: cufused.softmax(X4, axis=4), ValueError, "axis 4"),
    (lambda: cufused.softmax(X4, axis=(1, 1)), ValueError, "repeated"),
    (lambda: cufused.softmax(X4, axis=1.0), TypeError, "axis"),
    (lambda: cufused.softmax(X4, axis=()), ValueError, "axis"),
    (lambda: cufused.conv2d(X4, np.ones((2, 4, 0, 3), np.float32), padding="same"), ValueError,
     "weight has a zero-sized dimension"),
    (lambda: cufused.softmax(np.ones((), np.float32)), ValueError, "dimension"),
    (lambda: pipeline_a(num_groups=3), ValueError, "num_groups"),
    (lambda: pipeline_a(pool_kernel=7), ValueError,
     "pool_kernel: .* larger than the convolution output"),
    (lambda: pipeline_a(pool_kernel=(2, 3)), ValueError, "pool_kernel"),
    (lambda: pipeline_a(clamp_min=float("nan")), ValueError, "clamp_min"),
    (lambda: pipeline_a(clamp_max=[1.0]), TypeError, "clamp_max"),
    (lambda: pipeline_a(scale=np.ones((1, 7, 1, 1), np.float32)), ValueError, "scale"),
    (lambda: pipeline_a(scale=np.ones((2, 4), np.float32)), ValueError, "scale"),
    (lambda: pipeline_a(gn_weight=np.ones(4, np.float32)), ValueError, "gn_weight"),
    (lambda: pipeline_a(eps=float("inf")), ValueError, "eps"),
    (lambda: pipeline_a(method="fast"), ValueError, "method"),
    (lambda: pipeline_a(weight=np.ones((8, 3, 3, 3), np.float32)), ValueError, "weight"),
    (lambda: cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        X4, np.ones((4, 8, 3, 3), np.float32), None, None, None, None, num_groups=3),
     ValueError, "num_groups"),
    (lambda: cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        X4, np.ones((4, 8, 3, 3), np.float32), np.ones(5, np.float32), None, None, None,
        num_groups=2), ValueError, "bn_weight"),
    (lambda: cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        X4, np.ones((4, 8, 3, 3), np.float32), None, None, None, None, num_groups=2,
        momentum=-float("inf")), ValueError, "momentum"),
    (lambda: cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
        X5, np.ones((2, 3, 3, 3, 3), np.float32), 1.0, stride=2, padding=1, output_padding=2,
        pool_kernel=2, clamp_min=0, clamp_max=1), ValueError, "output_padding"),
    (lambda: cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
        X5, np.ones((2, 3, 3, 3, 3), np.float32), 1.0, stride=2, padding=1, output_padding=1,
        pool_kernel=5, clamp_min=0, clamp_max=1), ValueError, "pool_kernel: .* larger than x"),
    (lambda: cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
        X4, np.ones((2, 3, 3, 3, 3), np.float32), 1.0, stride=2, padding=1, output_padding=1,
        pool_kernel=2, clamp_min=0, clamp_max=1), ValueError, "NCDHW"),
    (lambda: cufused.set_default_precision("double"), ValueError, "precision"),
    # Checked on the NumPy path as on the GPU's; no OverflowError or unhashable-type error.
    (lambda: pipeline_a(scale=np.full(8, 1 + 2j)), TypeError, "scale has dtype complex128"),
    (lambda: pipeline_a(scale=np.array(["2.0"] * 8)), TypeError, "scale has dtype"),
    (lambda: pipeline_a(scale=np.arange(8)), TypeError, "scale has dtype int64"),
    (lambda: cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
        X5, np.ones((2, 3, 3, 3, 3), np.float32), np.complex128(2.0), stride=2, padding=1,
        output_padding=1, pool_kernel=2, clamp_min=0, clamp_max=1), TypeError, "scale"),
    (lambda: cufused.group_norm(X4, 2, eps=10**400), ValueError, "eps is out of float range"),
    (lambda: pipeline_a(clamp_max=-10**400), ValueError, "clamp_max"),
    (lambda: pipeline_a(scale=10**400), ValueError, "scale"),
    # A string option of another type is a TypeError (no unhashable-type error either).
    (lambda: cufused.batch_norm(X4, activation=["tanh"]), TypeError, "activation"),
    (lambda: pipeline_a(method=np.array(["fused", "unfused"])), TypeError, "method"),
    (lambda: cufused.conv2d(X4, W, precision=1), TypeError, r"precision .* or None, got int"),
    (lambda: cufused.set_default_precision(None), TypeError,
     r"precision must be one of \('ieee', 'tf32', '3xtf32'\), got NoneType"),
    # Memory: the reference's padded pool input; a sample of an empty batch's output.
    (lambda: cufused.max_pool3d(np.ones((1, 1, 4, 4, 4)), 2**16 + 1, 1, 2**15), ValueError,
     "padded input of the pool"),  # 2 PiB: past any host's memory
    (lambda: cufused.conv2d(X4[:0], W, padding=2**31 - 1), ValueError,
     r"convolution output .* GiB a sample"),
    (lambda: cufused.conv2d(X4, W, out=np.empty((2, 8, 6, 6), ">f4")), ValueError,
     "non-native byte order"),
    (lambda: cufused.group_norm(np.ma.masked_less(X4, 0.5), 2), TypeError, "x is a masked"),
    (lambda: cufused.set_conv_autotune("no"), TypeError, "enabled must be a bool"),
    (lambda: cufused.set_conv_graph_replay(1), TypeError, "enabled must be a bool"),
    (lambda: cufused.group_norm(X4, 0), ValueError, "num_groups=0 must be positive"),
    (lambda: cufused.group_norm(X4, -2), ValueError, "num_groups=-2 must be positive"),
    (lambda: cufused.group_norm(X4, 2, C8[:4], C8[:3]), ValueError,
     "bias must hold one value per channel"),
    (lambda: cufused.conv2d(np.ones((1, 4, 5, 5)), np.ones((7, 2, 3, 3)), groups=2),
     ValueError, "weight must have shape .* out_channels divisible by groups=2"),
    (lambda: cufused.batch_norm(X4, momentum=float("inf")), ValueError,
     "momentum must be finite"),
    (lambda: pipeline_a(scale=np.ones((1, 1, 1, 1, 1))), ValueError,
     "scale must hold one value per channel"),
    (lambda: (lambda x: cufused.softmax(x, axis=(2, 3), out=x.swapaxes(2, 3)))(X4.copy()),
     ValueError, r"out overlaps the memory of x \(only exactly the same array"),
]


@pytest.mark.parametrize("call,exc,fragment", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_bad_input_raises_with_a_clear_message(call, exc, fragment):
    with pytest.raises(exc, match=fragment):
        call()


def test_numpy_scalars_and_the_first_axis_are_taken():
    # NumPy integers and bools stand for ints and bools, and axis=-ndim is the first axis,
    # as in NumPy and PyTorch.
    x = np.random.default_rng(0).random((2, 4, 8, 8))
    w = np.random.default_rng(1).random((8, 4, 3, 3))
    assert np.array_equal(cufused.conv2d(x, w, stride=np.int64(2)), cufused.conv2d(x, w, stride=2))
    assert np.array_equal(cufused.batch_norm(x, training=np.True_), cufused.batch_norm(x))
    assert np.array_equal(cufused.softmax(x, axis=-4), cufused.softmax(x, axis=0))


def test_the_convolution_argument_cache_keeps_the_types():
    # A cached (1, 1) must not stand in for (True, 1) or (1.0, 1): after the valid call, the
    # same call with a bool or a float size is still refused.
    cufused.conv2d(X4, W[:, :4], stride=(1, 1))
    for stride in ((True, 1), (1.0, 1)):
        with pytest.raises(TypeError, match="stride"):
            cufused.conv2d(X4, W[:, :4], stride=stride)


def test_a_torch_tensor_is_pointed_to_cufused_torch():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"weight must be a numpy.ndarray or cupy.ndarray, got "
                                        r"Tensor; cufused.torch's operators"):
        cufused.conv2d(X4, torch.from_numpy(W))


def test_mixing_numpy_and_cupy_is_a_type_error_naming_the_argument(monkeypatch):
    class FakeCupyArray:  # what get_array_module sees of a CuPy array: a cupy.ndarray
        pass

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=FakeCupyArray))
    fake = FakeCupyArray()
    with pytest.raises(TypeError, match="weight is a cupy array but x is a numpy array"):
        cufused._arrays.get_array_module(x=X4, weight=fake)


def test_cupy_arrays_on_two_devices_are_a_value_error_naming_the_argument(monkeypatch):
    class FakeCupyArray:  # a cupy.ndarray as get_array_module sees it: its device id
        def __init__(self, device_id):
            self.data = types.SimpleNamespace(device_id=device_id)

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=FakeCupyArray))
    monkeypatch.setattr(cufused._arrays, "import_cupy", lambda: sys.modules["cupy"])
    assert cufused._arrays.get_array_module(x=FakeCupyArray(1), weight=FakeCupyArray(1)) \
        is sys.modules["cupy"]
    with pytest.raises(ValueError, match="weight is on CUDA device 1 but x is on CUDA device 0"):
        cufused._arrays.get_array_module(x=FakeCupyArray(0), weight=FakeCupyArray(1))


def test_errors_come_before_any_work():
    # A wrong option after valid arrays: nothing is written to out.
    out = np.full((2, 8, 3, 3), 7.0, dtype=np.float32)
    with pytest.raises(ValueError, match="clamp_max"):
        pipeline_a(clamp_max=float("nan"), out=out)
    assert np.all(out == 7.0)


def test_precision_default_context_manager_restores():
    assert cufused.get_default_precision() == "ieee"
    with cufused.default_precision("tf32"):
        assert cufused.get_default_precision() == "tf32"
    assert cufused.get_default_precision() == "ieee"


def test_gpu_call_without_cupy_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    with pytest.raises(ImportError, match=r"cufused\[cuda12\] or cufused\[cuda13\]"):
        cufused._arrays.import_cupy()


def test_3xtf32_is_a_precision(rng):
    x = rng.random((1, 2, 5, 5))
    w = rng.random((3, 2, 3, 3))
    # NumPy input runs the float64 reference whatever the precision.
    np.testing.assert_array_equal(cufused.conv2d(x, w, precision="3xtf32"), cufused.conv2d(x, w))
    with cufused.default_precision("3xtf32"):
        assert cufused.get_default_precision() == "3xtf32"
    with pytest.raises(ValueError, match="3xtf32"):
        cufused.conv2d(x, w, precision="fp16")


def test_implicit_gemm_route_leaves_rows_past_int32_to_cudnn():
    # A stride-1 transposed convolution whose forward padding, d * (k - 1) - p, is 2**31:
    # the implicit GEMM's int32 row arithmetic cannot hold it, so the route is cuDNN's.
    import dataclasses
    import types

    from cufused._ops._conv_args import ConvArgs
    from cufused._ops.convolution import _igemm_route

    dense = types.SimpleNamespace(c_contiguous=True)
    x = types.SimpleNamespace(ndim=4, flags=dense, shape=(1, 1, 2, 2))
    w = types.SimpleNamespace(shape=(1, 1, 4, 4), flags=dense)
    far = ConvArgs(True, (1, 1), (2**31 - 1,) * 2, (0, 0), (1431655765,) * 2, 1, (1, 1, 5, 5))
    near = ConvArgs(True, (1, 1), (1, 1), (0, 0), (1, 1), 1, (1, 1, 5, 5))
    assert _igemm_route(x, w, far, "tf32", None, None) is None
    assert _igemm_route(x, w, near, "tf32", None, None) is not None
    # More output channels than the grid's 65535 tiles of 64, and a reduction over
    # C * kh * kw values past int32: cuDNN's too.
    forward = ConvArgs(False, (1, 1), (1, 1), (0, 0), (1, 1), 1, (1, 64 * 65535, 1, 1))
    assert _igemm_route(x, types.SimpleNamespace(shape=(64 * 65535, 1, 1, 1), flags=dense),
                        forward, "tf32", None, None) is not None
    wide = dataclasses.replace(forward, out_shape=(1, 64 * 65535 + 1, 1, 1))
    assert _igemm_route(x, types.SimpleNamespace(shape=(64 * 65535 + 1, 1, 1, 1), flags=dense),
                        wide, "tf32", None, None) is None
    deep = types.SimpleNamespace(ndim=4, flags=dense, shape=(1, 2**27, 4, 4))
    one = dataclasses.replace(forward, out_shape=(1, 1, 1, 1))
    assert _igemm_route(deep, types.SimpleNamespace(shape=(1, 2**27, 4, 4), flags=dense), one,
                        "tf32", None, None) is None


@pytest.fixture
def batch_norm_forms(monkeypatch):
    """The ``centered_only`` that each ``batch_norm`` call hands its GPU path (built for NumPy
    inputs too), with the call's batch."""
    import cufused._ops.normalization as ops

    forms = []

    def record(call):
        forms.append((call.args[1].shape[0], call.args[-1]))
        return call

    monkeypatch.setattr(ops, "replayed", record)
    return forms


@pytest.mark.parametrize("shape,weight,bias,training,native", [
    ((3, 4, 5), True, True, True, False),  # cuDNN: a * x + b for non-finite coefficients
    ((3, 4, 5), True, True, False, False),
    ((3, 4, 5), False, True, True, True),  # PyTorch CUDA's native kernel: centered
    ((3, 4, 5), True, False, False, True),
    ((6, 4), True, True, True, True),
    ((65536, 2, 1), True, True, False, True),  # past the batch PyTorch hands to cuDNN
    ((65536, 2, 1), True, True, True, False),
    ((880802, 1, 1), True, True, True, True)])
def test_batch_norm_keeps_pytorch_cuda_s_form(batch_norm_forms, shape, weight, bias,
                                               training, native):
    rng = np.random.default_rng(0)
    c = shape[1]
    x = rng.standard_normal(shape).astype(np.float32)
    w, b = (rng.standard_normal(c) if given else None for given in (weight, bias))
    cufused.batch_norm(x, w, b, running_mean=np.zeros(c), running_var=np.ones(c),
                       training=training)
    assert batch_norm_forms == [(shape[0], native)]


def test_torch_cuda_native_form_counts_elements():
    from cufused._ops.normalization import torch_cuda_native_form

    one = np.ones(3)
    assert not torch_cuda_native_form((2**19, 2**11 - 1, 2), one, one, True)
    assert torch_cuda_native_form((2**19, 2**11, 2), one, one, True)  # 2**31 elements


def test_dask_batch_norm_takes_the_whole_batch_s_form(batch_norm_forms, monkeypatch):
    # 70000 samples pass the 65535 that PyTorch hands cuDNN in inference, in chunks that do
    # not: every chunk takes the whole batch's form, as the single call does. In training
    # (below 880801) the phase that normalizes with the batch statistics takes cuDNN's.
    cdask = pytest.importorskip("cufused.dask")
    da = pytest.importorskip("dask.array")
    import cufused.dask._blocks as blocks

    phases = []
    normalized_batch = blocks._normalized_batch

    def record(graph, statistics, task, *args, **kwargs):
        phases.append(task.keywords["centered_only"])
        return normalized_batch(graph, statistics, task, *args, **kwargs)

    monkeypatch.setattr(blocks, "_normalized_batch", record)
    x = np.random.default_rng(1).standard_normal((70000, 2, 1)).astype(np.float32)
    for training in (False, True):
        y = cdask.batch_norm(da.from_array(x, chunks=(35000, 2, 1)), np.ones(2), np.zeros(2),
                             running_mean=np.zeros(2), running_var=np.ones(2),
                             training=training)
        y.compute(scheduler="sync")
        if not training:
            assert [native for n, native in batch_norm_forms if n > 0] == [True, True]
    assert phases == [False]
