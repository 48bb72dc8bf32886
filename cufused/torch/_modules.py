"""The KernelBench level 2 models as ``nn.Module`` classes on the ``torch.ops.cufused``
operators.

The operators are looked up when ``forward`` runs; :mod:`cufused.torch`, which imports this
module, registers them. Like the operators, the modules are forward-only, but unlike them they
also run in grad mode with parameters that require grad (``nn.Module``'s default, and how
KernelBench times a model): the result then carries a backward that raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy
import torch
from torch.nn.utils import parametrize

from .._ops._conv_args import _named_padding
from .._precision import resolve_precision
from ..pipelines._common import clamp_bounds

__all__ = [
    "Conv2dGroupNormScaleMaxPoolClamp",
    "ConvTranspose2dBatchNormTanhMaxPoolGroupNorm",
    "ConvTranspose3dAvgPoolClampSoftmaxMultiply",
]

_ops = torch.ops.cufused


# ---------------------------------------------------------------------------------- modules


class _NoBackward(torch.autograd.Function):
    """A module's result in grad mode: ``run(x)`` runs with grad mode off, and the result is
    recorded against ``x`` and the parameters that require grad with a backward that raises
    (``torch.ops.cufused._no_backward``), so that a loss built on it fails at ``backward()``
    instead of leaving those parameters without a gradient. The backward is an operator with
    a fake kernel, so that ``torch.compile(fullgraph=True)`` traces it; it raises only where
    it runs. (``torch.export`` traces the forward; its program runs without autograd.)"""

    @staticmethod
    def forward(ctx, name: str, run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.name = name
        ctx.save_for_backward(*(t for t, needs in zip((x, *params), ctx.needs_input_grad[2:])
                                if needs))
        with torch.no_grad():
            return run(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = iter(_ops._no_backward.default(ctx.name, grad, list(ctx.saved_tensors)))
        return (None, None, *(next(grads) if needs else None
                              for needs in ctx.needs_input_grad[2:]))


class _ForwardOnlyModule(torch.nn.Module):
    """``forward`` checks the subclass's layer settings (``_settings()``, before any weight
    is read), then runs ``_run(x, weights, settings)`` on its ``_weights()``, read once;
    in grad mode with ``x`` or one of those tensors requiring grad, through
    :class:`_NoBackward` (the operators themselves refuse such inputs). The
    tensors are named, not found by ``parameters()``: a ``DataParallel`` replica holds its
    weights as plain tensors. ``_SUBMODULES`` names the subclass's layers and the class each
    must be: the fused call computes those classes' operations, whatever is installed."""

    _SUBMODULES: dict[str, type] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The fused pipeline of ``x`` with this module's parameters (and, for the BatchNorm
        module in training, its running buffers updated), as the KernelBench model computes
        it.

        Parameters
        ----------
        x : torch.Tensor
            The input batch, float32 on a CUDA device (float16/32/64 on the CPU, where the
            float64 reference runs).

        Returns
        -------
        torch.Tensor
            A new tensor of ``x``'s dtype and device. In grad mode with ``x`` or a parameter
            requiring grad it has a ``grad_fn`` whose backward raises: cufused is
            forward-only.
        """
        for name, cls in self._SUBMODULES.items():
            _check_layer(getattr(self, name), name, cls)
        settings = self._settings()
        # Read once, after the settings' checks: a parametrized weight is computed at each
        # read (spectral_norm's power iteration, which updates its vectors, among them).
        weights = self._weights()
        if torch.is_grad_enabled():
            tracked = [t for t in weights if t is not None and t.requires_grad]
            if tracked or x.requires_grad:
                return _NoBackward.apply(type(self).__name__,
                                         lambda x: self._run(x, weights, settings), x, *tracked)
        return self._run(x, weights, settings)


def _check_layer(module: torch.nn.Module, name: str, cls: type) -> None:
    """Refuse a layer whose computation the fused call would not reproduce: a class other
    than ``cls`` (a parametrized ``cls``, whose parameters the fused call reads through the
    parametrizations, is one), or forward hooks (``torch.nn.utils.prune``'s among them), which
    the fused call, not calling the layer, would skip."""
    kind = type(module)
    if kind is not cls and not (parametrize.is_parametrized(module) and kind.__bases__ == (cls,)):
        raise ValueError(f"{name} must be a torch.nn.{cls.__name__}, as the fused pipeline "
                         f"computes, got {kind.__module__}.{kind.__qualname__}")
    if module._forward_pre_hooks or module._forward_hooks:
        raise ValueError(f"{name} has forward hooks, which the fused pipeline does not run "
                         "(it reads the layer's parameters, it does not call the layer)")


def _clamp_bounds(clamp_min: Any, clamp_max: Any) -> tuple[float | None, float | None]:
    """A module's clamp bounds as the fused call takes them: real numbers (infinities
    included; a one-value tensor or array as its number) as floats, None for no bound;
    anything else refused, naming the argument."""
    bounds = tuple(v.item() if isinstance(v, (torch.Tensor, numpy.ndarray)) and v.ndim == 0
                   else v for v in (clamp_min, clamp_max))
    clamp_bounds(*bounds)
    return tuple(None if v is None else float(v) for v in bounds)


def _checked_precision(precision: str | None) -> str | None:
    """A module's precision, checked when the module is built: None (cufused's default when
    the module runs) or one of the precisions."""
    if precision is not None:
        resolve_precision(precision)
    return precision


def _outside_compiled_graphs(reason: str) -> Callable:
    """``torch.compiler.disable``, with ``reason`` where PyTorch takes one (2.8 and newer)."""
    try:
        return torch.compiler.disable(reason=reason)
    except TypeError:
        return torch.compiler.disable()


@_outside_compiled_graphs("BatchNorm's momentum=None reads num_batches_tracked on the host, as "
                          "nn.BatchNorm2d does; the fused call takes a float")
def _cumulative_momentum(num_batches_tracked: torch.Tensor) -> float:
    """The weight of this batch in a cumulative moving average (``momentum=None``). Compiled
    models run it outside the graph: ``fullgraph=True`` refuses it by this reason, as it
    refuses ``nn.BatchNorm2d`` with ``momentum=None``."""
    return 1.0 / (float(num_batches_tracked) + 1.0)


def _square_window(kernel_size: int | tuple[int, ...], nd: int, name: str) -> int:
    """A pool window as the fused operators take it: one int, its side (a tuple of ``nd``
    equal sides, as ``nn.MaxPool2d`` / ``nn.AvgPool3d`` keep it, gives that side)."""
    if isinstance(kernel_size, (tuple, list)):
        if len(kernel_size) != nd or len(set(kernel_size)) != 1:
            raise ValueError(f"{name} must be an int or {nd} equal sides, as the fused "
                             f"pipeline pools, got {tuple(kernel_size)}")
        kernel_size = kernel_size[0]
    return kernel_size


def _require(module: torch.nn.Module, name: str, attr: str, expected: Any,
             default: Any = None) -> None:
    """Refuse a submodule setting that the fused call has no option for: a ``ValueError``
    naming ``name.attr`` unless each side of the setting (``default`` where ``module`` has
    none) is ``expected``."""
    value = getattr(module, attr, default)
    sides = value if isinstance(value, (tuple, list)) else (value,)
    if sides.count(expected) != len(sides):
        raise ValueError(f"{name}.{attr} must be {expected!r}, as the fused pipeline computes, "
                         f"got {value!r}")


def _check_transposed(conv: torch.nn.Module, name: str) -> None:
    """``conv`` (an ``nn.ConvTranspose2d`` / ``3d``) as the fused pipelines convolve: no
    dilation, zero padding (PyTorch's transposed convolutions have no other mode)."""
    _require(conv, name, "dilation", 1)
    _require(conv, name, "padding_mode", "zeros")


def _conv_padding(conv: torch.nn.Conv2d, name: str) -> tuple[int | tuple[int, ...],
                                                               tuple[int, ...]]:
    """The padding of ``conv`` as pipeline A takes it, ints (``"valid"`` and ``"same"`` as
    the ints they mean), and the zeros that an uneven ``"same"`` puts after the input
    (``torch.nn.functional.pad``'s order, empty for none), after refusing what the fused call
    cannot express: dilation, or a ``padding_mode`` other than ``"zeros"`` where it pads."""
    _require(conv, name, "dilation", 1)
    padding, after = conv.padding, ()
    if isinstance(padding, str):
        try:
            padding, extension = _named_padding(padding, conv.stride, conv.dilation,
                                                conv.kernel_size, 2)
        except ValueError as err:
            raise ValueError(f"{name}.{err}") from None
        after = tuple(v for e in reversed(extension) for v in (0, e))
    sides = padding if isinstance(padding, (tuple, list)) else (padding,)
    if conv.padding_mode != "zeros" and (sides.count(0) != len(sides) or after):
        raise ValueError(f"{name}.padding_mode must be 'zeros' where the convolution pads, as "
                         f"the fused pipeline pads, got {conv.padding_mode!r}")
    return padding, after


def _pool_window(pool: torch.nn.Module, nd: int, name: str) -> int:
    """The window of ``pool`` (an ``nn.MaxPool2d`` / ``nn.AvgPool3d``) as the fused pipelines
    pool: square, its stride the window, no padding, no dilation, floor mode, no divisor
    override; any other setting is refused."""
    k = pool.kernel_size
    if not isinstance(k, int):
        k = _square_window(k, nd, f"{name}.kernel_size")
    if pool.stride is not None:  # None: the window, as in PyTorch's pools
        _require(pool, name, "stride", k)
    _require(pool, name, "padding", 0)
    _require(pool, name, "ceil_mode", False)
    _require(pool, name, "dilation", 1, 1)
    _require(pool, name, "return_indices", False, False)
    _require(pool, name, "divisor_override", None)
    return k


def _check_channel_scale(scale_shape: tuple[int, ...], channels: int,
                         name: str = "scale_shape", ndim: int = 4) -> None:
    """``x * scale`` with ``scale`` of ``scale_shape`` (the argument ``name``) must give each
    of the ``channels`` channels of an (N, C, ...) ``x`` of ``ndim`` dimensions one value, as
    the fused pipeline scales: one value, or the C values on the channel axis under
    broadcasting (``(C, 1, 1)`` or ``(1, C, 1, 1)`` in 4-D). PyTorch aligns a ``(C,)`` scale
    with the width instead."""
    shape = (scale_shape,) if isinstance(scale_shape, int) else tuple(scale_shape)
    axis = len(shape) - (ndim - 1)  # the channel axis, aligned from the right
    per_channel = (len(shape) in (ndim - 1, ndim) and shape[axis] == channels
                   and all(s == 1 for i, s in enumerate(shape) if i != axis))
    if not (per_channel or (len(shape) <= ndim and all(s == 1 for s in shape))):
        ones = (1,) * (ndim - 2)
        raise ValueError(f"{name} must give each of the {channels} output channels one "
                         f"value under x * scale's broadcasting, as the fused pipeline scales: "
                         f"{(channels, *ones)}, {(1, channels, *ones)} or one value; got "
                         f"{shape} (PyTorch aligns a ({channels},) scale with the width)")


class Conv2dGroupNormScaleMaxPoolClamp(_ForwardOnlyModule):
    """KernelBench level 2 "Conv2d_GroupNorm_Scale_MaxPool_Clamp" as one fused call.

    ``clamp(max_pool2d(group_norm(conv2d(x)) * scale, maxpool_kernel_size), clamp_min,
    clamp_max)`` through ``torch.ops.cufused.conv2d_groupnorm_scale_maxpool_clamp``.

    Parameters
    ----------
    in_channels, out_channels : int
        Convolution channels.
    kernel_size : int or tuple of int
        Convolution window (stride 1, no padding).
    num_groups : int
        GroupNorm groups; must divide ``out_channels``.
    scale_shape : tuple of int
        Shape of the ``scale`` parameter: ``(out_channels, 1, 1)`` (KernelBench's),
        ``(1, out_channels, 1, 1)`` or one value, the shapes by which ``x * scale`` scales
        each channel by one value.
    maxpool_kernel_size : int or tuple of int
        Max-pool window and stride: one side, or a tuple of equal sides.
    clamp_min, clamp_max : float or None
        Bounds of the final clamp, after the pool (None: no bound on that side, as
        ``torch.clamp`` takes it).
    precision : {"ieee", "tf32", "3xtf32"}, optional
        Convolution precision on the GPU; ``None`` uses cufused's default.

    Notes
    -----
    The submodules and parameters are the KernelBench model's (``conv``, ``group_norm``,
    ``scale``, ``maxpool``), created in the same order, so the same seed gives the same
    parameters and ``state_dict`` loads both ways. ``forward`` refuses (``ValueError``) a
    submodule setting that the fused call has no option for: a dilated or grouped ``conv``,
    one that pads with a ``padding_mode`` other than ``"zeros"``, a ``maxpool`` whose stride
    is not its window or with padding, dilation, ``ceil_mode`` or ``return_indices``.
    Forward-only (see the module docstring).

    Examples
    --------
    >>> import torch
    >>> from cufused.torch import Conv2dGroupNormScaleMaxPoolClamp
    >>> model = Conv2dGroupNormScaleMaxPoolClamp(3, 8, 3, 4, (8, 1, 1), 2, 0.0, 1.0)
    >>> with torch.no_grad():
    ...     y = model(torch.rand(2, 3, 10, 10))
    >>> y.shape
    torch.Size([2, 8, 4, 4])
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int],
                 num_groups: int, scale_shape: tuple[int, ...], maxpool_kernel_size: int,
                 clamp_min: float | None, clamp_max: float | None, *,
                 precision: str | None = None) -> None:
        super().__init__()
        _check_channel_scale(scale_shape, out_channels)
        self.conv = torch.nn.Conv2d(in_channels, out_channels, kernel_size)
        self.group_norm = torch.nn.GroupNorm(num_groups, out_channels)
        self.scale = torch.nn.Parameter(torch.ones(scale_shape))
        _square_window(maxpool_kernel_size, 2, "maxpool_kernel_size")
        self.maxpool = torch.nn.MaxPool2d(kernel_size=maxpool_kernel_size)
        self.clamp_min, self.clamp_max = _clamp_bounds(clamp_min, clamp_max)
        self.precision = _checked_precision(precision)

    _SUBMODULES = {"conv": torch.nn.Conv2d, "group_norm": torch.nn.GroupNorm,
                   "maxpool": torch.nn.MaxPool2d}

    def _weights(self) -> tuple[torch.Tensor | None, ...]:
        conv, gn = self.conv, self.group_norm
        return conv.weight, conv.bias, gn.weight, gn.bias, self.scale

    def _settings(self) -> dict:
        _require(self.conv, "conv", "groups", 1)
        padding, after = _conv_padding(self.conv, "conv")
        return dict(padding=padding, after=after,
                    pool=_pool_window(self.maxpool, 2, "maxpool"))

    def _run(self, x: torch.Tensor, weights: tuple, settings: dict) -> torch.Tensor:
        conv, gn = self.conv, self.group_norm
        conv_weight, conv_bias, gn_weight, gn_bias, scale = weights
        _check_channel_scale(tuple(scale.shape), conv.out_channels, "scale's shape")
        if settings["after"] and x.dim() == 4:  # uneven "same" (the op refuses another x)
            x = torch.nn.functional.pad(x, settings["after"])
        return _ops.conv2d_groupnorm_scale_maxpool_clamp.default(
            x, conv_weight, conv_bias, gn_weight, gn_bias, scale,
            num_groups=gn.num_groups, pool_kernel=settings["pool"],
            clamp_min=self.clamp_min, clamp_max=self.clamp_max, stride=conv.stride,
            padding=settings["padding"], eps=gn.eps, precision=self.precision)


class ConvTranspose2dBatchNormTanhMaxPoolGroupNorm(_ForwardOnlyModule):
    """KernelBench level 2 "ConvTranspose2d_BatchNorm_Tanh_MaxPool_GroupNorm" on cufused.

    ``group_norm(max_pool2d(tanh(batch_norm(conv_transpose2d(x))), 2, 2))``. In training mode
    (the default of every ``nn.Module``) one fused call runs it,
    ``torch.ops.cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm``, with the batch
    statistics, and updates ``batch_norm.running_mean`` / ``running_var`` /
    ``num_batches_tracked`` as ``nn.BatchNorm2d`` does. In eval mode BatchNorm uses the running
    statistics, which the fused pipeline does not do: four building-block operators run it
    (transposed convolution, BatchNorm + tanh, max pool, GroupNorm).

    Parameters
    ----------
    in_channels, out_channels : int
        Transposed-convolution channels.
    kernel_size, stride, padding : int or tuple of int
        Transposed-convolution options.
    groups : int
        Accepted and stored as ``self.groups`` but not used: the KernelBench model does not
        pass it to its ``nn.ConvTranspose2d`` either, so the weight has shape
        ``(in_channels, out_channels, k, k)`` and the results are the model's.
    num_groups : int
        GroupNorm groups; must divide ``out_channels``.
    precision : {"ieee", "tf32", "3xtf32"}, optional
        Convolution precision on the GPU; ``None`` uses cufused's default.

    Notes
    -----
    Submodules and parameters are the KernelBench model's (``conv_transpose``, ``batch_norm``,
    ``tanh``, ``max_pool``, ``group_norm``), so ``state_dict`` loads both ways. The fused call
    uses one epsilon for both norms; when ``batch_norm.eps`` and ``group_norm.eps`` differ, the
    building blocks run instead; the pool takes ``max_pool``'s window. ``forward`` refuses
    (``ValueError``), in both modes, a dilated ``conv_transpose`` or one with a
    ``padding_mode`` other than ``"zeros"``, and a ``max_pool`` whose stride is not its window
    or with padding, dilation, ``ceil_mode`` or ``return_indices``. Forward-only (see the
    module docstring).

    Examples
    --------
    >>> import torch
    >>> from cufused.torch import ConvTranspose2dBatchNormTanhMaxPoolGroupNorm
    >>> model = ConvTranspose2dBatchNormTanhMaxPoolGroupNorm(4, 8, 3, 1, 1, 2, 2)
    >>> with torch.no_grad():
    ...     y = model(torch.rand(2, 4, 6, 6))
    >>> y.shape, int(model.batch_norm.num_batches_tracked)
    (torch.Size([2, 8, 3, 3]), 1)
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int],
                 stride: int | tuple[int, int], padding: int | tuple[int, int], groups: int,
                 num_groups: int, *, precision: str | None = None) -> None:
        super().__init__()
        self.conv_transpose = torch.nn.ConvTranspose2d(in_channels, out_channels, kernel_size,
                                                       stride=stride, padding=padding)
        self.batch_norm = torch.nn.BatchNorm2d(out_channels)
        self.tanh = torch.nn.Tanh()
        self.max_pool = torch.nn.MaxPool2d(kernel_size=2, stride=2)
        self.group_norm = torch.nn.GroupNorm(num_groups=num_groups, num_channels=out_channels)
        self.groups = groups
        self.precision = _checked_precision(precision)

    _SUBMODULES = {"conv_transpose": torch.nn.ConvTranspose2d,
                   "batch_norm": torch.nn.BatchNorm2d, "tanh": torch.nn.Tanh,
                   "max_pool": torch.nn.MaxPool2d, "group_norm": torch.nn.GroupNorm}

    def _weights(self) -> tuple[torch.Tensor | None, ...]:
        ct, bn, gn = self.conv_transpose, self.batch_norm, self.group_norm
        return ct.weight, ct.bias, bn.weight, bn.bias, gn.weight, gn.bias

    def _settings(self) -> dict:
        _check_transposed(self.conv_transpose, "conv_transpose")
        return dict(pool=_pool_window(self.max_pool, 2, "max_pool"))

    def _run(self, x: torch.Tensor, weights: tuple, settings: dict) -> torch.Tensor:
        bn, ct = self.batch_norm, self.conv_transpose
        ct_weight, ct_bias, bn_weight, bn_bias, gn_weight, gn_bias = weights
        k = settings["pool"]
        # BatchNorm's bookkeeping, as nn.BatchNorm2d.forward does it, except that the batch
        # is counted with the running statistics' update, once the call that updates them has
        # succeeded: a call that fails its checks first leaves the module as it was.
        momentum = 0.0 if bn.momentum is None else bn.momentum
        # The batch_norm layer's own mode decides, as nn.BatchNorm2d's forward reads it
        # (model.train() with model.batch_norm.eval() freezes its statistics).
        counted = (bn.training and bn.track_running_stats
                   and bn.num_batches_tracked is not None)
        if counted and bn.momentum is None:  # cumulative moving average, this batch included
            momentum = _cumulative_momentum(bn.num_batches_tracked)
        gn = self.group_norm
        batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
        track = not bn.training or bn.track_running_stats
        running_mean = bn.running_mean if track else None
        running_var = bn.running_var if track else None
        if batch_stats and running_mean is None and running_var is None:
            # Stand-ins that the call updates and nobody reads: Inductor (PyTorch 2.13) fails
            # on an optional mutable argument left None.
            running_mean = x.new_zeros(ct.out_channels)
            running_var = x.new_ones(ct.out_channels)
        if batch_stats and bn.eps == gn.eps:
            y = _ops.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm.default(
                x, ct_weight, bn_weight, bn_bias, gn_weight, gn_bias, num_groups=gn.num_groups,
                stride=ct.stride, padding=ct.padding, output_padding=ct.output_padding,
                groups=ct.groups, conv_bias=ct_bias, pool_kernel=k, eps=bn.eps,
                running_mean=running_mean, running_var=running_var, momentum=momentum,
                precision=self.precision)
            if counted:
                bn.num_batches_tracked.add_(1)
            return y
        y = _ops.conv_transpose2d.default(
            x, ct_weight, ct_bias, stride=ct.stride, padding=ct.padding,
            output_padding=ct.output_padding, groups=ct.groups, precision=self.precision)
        # In training the blocks update copies of the running statistics, which replace them
        # once the last block has succeeded, as the fused call's checks come before its update.
        staged = [b.clone() if batch_stats and b is not None else b
                  for b in (running_mean, running_var)]
        y = _ops.batch_norm.default(y, bn_weight, bn_bias, running_mean=staged[0],
                                    running_var=staged[1], training=batch_stats,
                                    momentum=momentum, eps=bn.eps, activation="tanh")
        y = _ops.max_pool2d.default(y, k, k)
        y = _ops.group_norm.default(y, gn.num_groups, gn_weight, gn_bias, eps=gn.eps)
        for buffer, new in zip((running_mean, running_var), staged):
            if new is not buffer:
                buffer.copy_(new)
        if counted:
            bn.num_batches_tracked.add_(1)
        return y


class ConvTranspose3dAvgPoolClampSoftmaxMultiply(_ForwardOnlyModule):
    """KernelBench level 2 "ConvTranspose3d_AvgPool_Clamp_Softmax_Multiply" as one fused call.

    ``softmax(clamp(conv_transpose3d(avg_pool3d(x)), clamp_min, clamp_max)) * scale`` with the
    softmax over D*H*W of each (sample, channel), through
    ``torch.ops.cufused.conv_transpose3d_avgpool_clamp_softmax_multiply``. The average pool
    comes first, on the input, as in the KernelBench model.

    Parameters
    ----------
    in_channels, out_channels : int
        Transposed-convolution channels.
    kernel_size, stride, padding, output_padding : int or tuple of int
        Transposed-convolution options.
    pool_kernel_size : int or tuple of int
        Average-pool window and stride: one side, or a tuple of equal sides.
    clamp_min, clamp_max : float or None
        Bounds of the clamp of the convolution output (of the pooled input), before the
        softmax (None: no bound on that side, as ``torch.clamp`` takes it).
    precision : {"ieee", "tf32", "3xtf32"}, optional
        Convolution precision on the GPU; ``None`` uses cufused's default.

    Notes
    -----
    Submodules and parameters are the KernelBench model's (``avg_pool``, ``conv_transpose``,
    ``scale`` of shape ``(1, out_channels, 1, 1, 1)``), so ``state_dict`` loads both ways.
    ``forward`` refuses (``ValueError``) a dilated ``conv_transpose`` or one with a
    ``padding_mode`` other than ``"zeros"``, and an ``avg_pool`` whose stride is not its window
    or with padding, ``ceil_mode`` or a ``divisor_override``.
    Forward-only (see the module docstring).

    Examples
    --------
    >>> import torch
    >>> from cufused.torch import ConvTranspose3dAvgPoolClampSoftmaxMultiply
    >>> model = ConvTranspose3dAvgPoolClampSoftmaxMultiply(2, 3, 3, 2, 1, 1, 2, 0.0, 1.0)
    >>> with torch.no_grad():
    ...     y = model(torch.rand(1, 2, 4, 4, 4))
    >>> y.shape, bool(torch.allclose(y.sum(dim=(2, 3, 4)), torch.ones(1, 3)))
    (torch.Size([1, 3, 4, 4, 4]), True)
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, ...],
                 stride: int | tuple[int, ...], padding: int | tuple[int, ...],
                 output_padding: int | tuple[int, ...], pool_kernel_size: int,
                 clamp_min: float | None, clamp_max: float | None, *,
                 precision: str | None = None) -> None:
        super().__init__()
        _square_window(pool_kernel_size, 3, "pool_kernel_size")
        self.avg_pool = torch.nn.AvgPool3d(pool_kernel_size)
        self.conv_transpose = torch.nn.ConvTranspose3d(
            in_channels, out_channels, kernel_size, stride=stride, padding=padding,
            output_padding=output_padding)
        self.clamp_min, self.clamp_max = _clamp_bounds(clamp_min, clamp_max)
        self.scale = torch.nn.Parameter(torch.ones(1, out_channels, 1, 1, 1))
        self.precision = _checked_precision(precision)

    _SUBMODULES = {"avg_pool": torch.nn.AvgPool3d, "conv_transpose": torch.nn.ConvTranspose3d}

    def _weights(self) -> tuple[torch.Tensor | None, ...]:
        ct = self.conv_transpose
        return ct.weight, ct.bias, self.scale

    def _settings(self) -> dict:
        _check_transposed(self.conv_transpose, "conv_transpose")
        return dict(pool=_pool_window(self.avg_pool, 3, "avg_pool"))

    def _run(self, x: torch.Tensor, weights: tuple, settings: dict) -> torch.Tensor:
        ct = self.conv_transpose
        ct_weight, ct_bias, scale = weights
        _check_channel_scale(tuple(scale.shape), ct.out_channels, "scale's shape", ndim=5)
        return _ops.conv_transpose3d_avgpool_clamp_softmax_multiply.default(
            x, ct_weight, scale, stride=ct.stride, padding=ct.padding,
            output_padding=ct.output_padding,
            pool_kernel=settings["pool"],
            clamp_min=self.clamp_min, clamp_max=self.clamp_max, conv_bias=ct_bias,
            groups=ct.groups, precision=self.precision)
