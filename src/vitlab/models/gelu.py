"""The official tanh GELU, computed faster on the CPU with the same numbers.

torch's CPU kernel for `gelu(approximate="tanh")` evaluates tanh with an accurate but slow vector routine: 3.5x
the time of its erf GELU (benchmarks/gelu.py). Two exact rewrites of the same function are used instead (tests/test_model_gelu.py):
- inference: fc1 and the GELU as one oneDNN matrix product with a GELU epilogue (within 5e-7 of torch's GELU),
  except the smallest products (SMALL_GELU_PRODUCT_MACS), where F.linear and torch's own GELU are faster;
- training: 0.5 x (1 + tanh(u)) = x * sigmoid(2u), with the slope computed in the same forward passes and saved
  (torch's sigmoid is fast), so the backward is one multiplication, and where fc2 follows, none: it runs in the
  epilogue of fc2's input-gradient product. Within 6e-7 of torch's GELU forward and 1e-5 of its gradient. On the
  Intel Xeon VM an MLP block's forward + backward at ViT-Ti/16, batch 32, takes 57.5 ms against 59.9 with torch's
  tanh kernel (its erf GELU, a different function: 52.4); the GELU alone 4.45 ms against 5.95, where recomputing
  the slope in the backward took 5.91 (docs/results/gelu_intel*.txt).
Elsewhere (GPU, bf16/fp16, tracing for ONNX, torch.compile, dispatch modes such as FlopCounterMode) the plain
`nn.GELU` runs.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from vitlab.models.fast_linear import (
    cpu_fp32_eager,
    linear,
    linear_act,
    needs_grad,
    onednn_linear_applies,
    onednn_linear_available,
    onednn_product,
    onednn_training,
    plain_layer,
    product_rows,
    product_within,
    weight_and_bias_gradients,
)

FAST_CPU_GELU = True  # benchmarks flip it to time torch's own kernel
_TWO_K1 = 2 * math.sqrt(2 / math.pi)  # 2u = x * (2 k1 + 2 k1 k2 x^2), k1 = sqrt(2/pi), k2 = 0.044715
_TWO_K1_K2 = _TWO_K1 * 0.044715


def _tanh_gelu_cpu_fp32(x: torch.Tensor, act: nn.Module) -> bool:
    """A plain tanh `nn.GELU` (a replaced or hooked activation runs as its module) on CPU fp32 eager work."""
    return FAST_CPU_GELU and plain_layer(act, nn.GELU) and act.approximate == "tanh" and cpu_fp32_eager(x)


# fc1 + GELU products up to this size run as F.linear and torch's tanh GELU instead of one oneDNN call: oneDNN's fixed
# cost per call outweighs the GELU kernel's slowness there. On the 2-core Intel Xeon VM the Fashion-MNIST ViT's fc1
# at batch 1 (50 x 64 -> 128, 0.41 M MAC) took 27.2 us through oneDNN against 23.8, at 100 rows 30.9 against 42.3;
# one-row products (a class-token-only last block at batch 1) gain too; the whole model at batch 1 ran 1.22-1.26x
# faster. `python benchmarks/linear.py --small` (docs/results/linear_small_gelu_intel.txt). Shape-based, as every
# route choice here. The limits stay within fast_linear's small-product rule, so the product below them is always
# F.linear's.
SMALL_GELU_PRODUCT_MACS = 500_000  # rows x in x out, products of fast_linear.SMALL_PRODUCT_MIN_ROWS rows or more
SMALL_FEW_ROW_GELU_PRODUCT_MACS = 200_000  # products of fewer rows


def small_gelu_product(rows: int, weight: torch.Tensor) -> bool:
    """Whether fc1 + GELU with `rows` rows and this (out, in) weight runs faster as F.linear and torch's GELU."""
    return product_within(rows, weight, SMALL_GELU_PRODUCT_MACS, SMALL_FEW_ROW_GELU_PRODUCT_MACS)


def fused_cpu_gelu_applies(x: torch.Tensor, act: nn.Module, fc: nn.Module) -> bool:
    """fc1 + GELU as one oneDNN call: CPU fp32 work that needs no gradient through them (the oneDNN op has no
    backward) of plain layers, above the smallest products (small_gelu_product)."""
    return (not needs_grad(x, fc.weight, fc.bias) and _tanh_gelu_cpu_fp32(x, act) and plain_layer(fc, nn.Linear)
            and onednn_linear_available() and fc.weight.dtype == torch.float32
            and not small_gelu_product(product_rows(x), fc.weight))


# Rows of h per pass: the chunk and its scratch (about 1.2 MB each) stay in the cores' caches through the seven
# passes, which otherwise stream from main memory at ViT-S/16 size and up. Shape-based, so a run and its resume
# compute alike.
CHUNK_ELEMENTS = 300_000


def tanh_gelu_and_slope(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gelu(h), gelu'(h)) for the official tanh GELU, in seven elementwise passes with no tanh.

    gelu(h) = h * s with s = sigmoid(2u), 2u = h (2k1 + 2k1k2 h^2); gelu'(h) = s + h s (1 - s) (2k1 + 6k1k2 h^2),
    written as lerp(z, 1, s) = z + s (1 - z) with z = gelu(h) (2k1 + 6k1k2 h^2): the same value, one pass fewer.
    """
    flat = h.reshape(-1, h.shape[-1])
    y, slope = torch.empty_like(flat), torch.empty_like(flat)
    step = max(1, CHUNK_ELEMENTS // flat.shape[1])
    scratch = flat.new_empty((min(step, flat.shape[0]), flat.shape[1]))
    two_k1, one = h.new_tensor(_TWO_K1), h.new_tensor(1.0)
    for start in range(0, flat.shape[0], step):
        rows = slice(start, start + step)
        hc, yc, dc = flat[rows], y[rows], slope[rows]
        s = torch.addcmul(two_k1, hc, hc, value=_TWO_K1_K2, out=scratch[: len(hc)]).mul_(hc).sigmoid_()
        torch.mul(s, hc, out=yc)
        torch.addcmul(two_k1, hc, hc, value=3 * _TWO_K1_K2, out=dc).mul_(yc)
        torch.lerp(dc, one, s, out=dc)
    return y.view(h.shape), slope.view(h.shape)


class SlopeSavingTanhGelu(torch.autograd.Function):
    """tanh GELU whose forward also computes its slope, so the backward is one multiplication.

    Saving the slope instead of recomputing it from h in the backward costs the same passes in the forward and
    saves five in the backward; it keeps one tensor for the backward where saving h and s kept two.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        y, slope = tanh_gelu_and_slope(h)
        ctx.save_for_backward(slope)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (slope,) = ctx.saved_tensors
        return grad * slope


class TanhGeluThenLinear(torch.autograd.Function):
    """fc2(gelu(h)) for training, with gelu's backward multiplication in the epilogue of fc2's input-gradient
    product (one oneDNN call: (grad @ W) * slope); otherwise the products of fast_linear.OneDnnLinear."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y, slope = tanh_gelu_and_slope(h)
        ctx.save_for_backward(y, slope, weight)
        ctx.has_bias = bias is not None
        return onednn_product(y, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, slope, weight = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad
        grad_h = torch.ops.mkldnn._linear_pointwise.binary(grad, slope, weight.t(), None, "mul") if need_h else None
        grad_w, grad_b = weight_and_bias_gradients(grad, y, need_w, need_b and ctx.has_bias)
        return grad_h, grad_w, grad_b


def linear_gelu(x: torch.Tensor, fc: nn.Linear, act: nn.Module) -> torch.Tensor:
    """act(fc(x)) by the fastest exact route for where it runs."""
    if fused_cpu_gelu_applies(x, act, fc):
        return linear_act(x, fc, "gelu", "tanh")
    h = linear(x, fc)
    if needs_grad(h) and _tanh_gelu_cpu_fp32(h, act):
        return SlopeSavingTanhGelu.apply(h)
    return act(h)


def mlp(x: torch.Tensor, fc1: nn.Linear, act: nn.Module, drop: nn.Module, fc2: nn.Linear) -> torch.Tensor:
    """fc2(drop(act(fc1(x)))) by the fastest exact route: in CPU fp32 training of the plain official layers with
    no dropout there, the GELU and fc2 as one autograd step (TanhGeluThenLinear)."""
    if not (plain_layer(drop, nn.Identity) and plain_layer(fc2, nn.Linear) and onednn_training()
            and onednn_linear_applies(x, fc2.weight) and needs_grad(x, fc1.weight, fc1.bias)):
        return linear(drop(linear_gelu(x, fc1, act)), fc2)
    h = linear(x, fc1)
    if not _tanh_gelu_cpu_fp32(h, act):
        return linear(act(h), fc2)
    return TanhGeluThenLinear.apply(h, fc2.weight, fc2.bias)
