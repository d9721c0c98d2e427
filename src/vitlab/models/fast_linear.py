"""The model's linear layers through oneDNN on the CPU: the same fp32 matrix products, faster than torch's
default route (`F.linear` -> MKL here).

On the 2-core AMD EPYC of docs/benchmarks.md whole ViTs run 1-11 % faster in inference and up to 9 % faster in
training steps this way (`python benchmarks/linear.py`); per product the forward and the input gradient are
mostly faster through oneDNN, the weight gradient through torch's own `mm`, so training uses oneDNN for two of
the three products. The choice is fixed, not measured per
run: a route picked by a timing could differ between a run and its resume, and exact resume needs the same
kernels. Results differ from `F.linear` only by the summation order of any fp32 GEMM (about 1e-6 relative;
tests/test_model_fast_linear.py). Elsewhere (GPU, other dtypes, autocast, tracing for ONNX, torch.compile,
dispatch modes such as FlopCounterMode) `F.linear` runs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

ONEDNN_LINEAR = True  # benchmarks and tests flip it to time or compare torch's own route


@functools.cache
def onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def cpu_fp32_eager(x: torch.Tensor) -> bool:
    """Plain eager fp32 work on the CPU: where the oneDNN routes compute exactly what torch's ops do."""
    return (
        x.device.type == "cpu" and x.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu") and not torch.jit.is_tracing() and not torch.compiler.is_compiling()
        and _get_current_dispatch_mode() is None  # FLOP counting, fake or meta tensors: the standard ops
    )


def onednn_linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return ONEDNN_LINEAR and cpu_fp32_eager(x) and weight.dtype == torch.float32 and onednn_linear_available()


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str = "none",
            algorithm: str = "") -> torch.Tensor:
    """x @ weight.T + bias (then `act`) in one oneDNN call; weight is (out, in) as in nn.Linear."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, act, [], algorithm)


class OneDnnLinear(torch.autograd.Function):
    """F.linear with the forward and the input gradient through oneDNN, the weight gradient through `mm`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = grad_w = grad_b = None
        if need_x:
            grad_x = _onednn(grad, weight.t(), None)  # grad @ weight
        grad_2d = grad.reshape(-1, grad.shape[-1])
        if need_w:
            grad_w = grad_2d.t().mm(x.reshape(-1, x.shape[-1]))
        if need_b and ctx.has_bias:
            grad_b = grad_2d.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, fc: nn.Linear) -> torch.Tensor:
    """fc(x) by the fastest exact route for where it runs."""
    if not onednn_linear_applies(x, fc.weight):
        return fc(x)
    if torch.is_grad_enabled() and (x.requires_grad or fc.weight.requires_grad
                                    or (fc.bias is not None and fc.bias.requires_grad)):
        return OneDnnLinear.apply(x, fc.weight, fc.bias)
    return _onednn(x, fc.weight, fc.bias)


def linear_act(x: torch.Tensor, fc: nn.Linear, act: str, algorithm: str) -> torch.Tensor:
    """act(fc(x)) as one oneDNN call (inference only: the fused op has no backward)."""
    return _onednn(x, fc.weight, fc.bias, act, algorithm)
