"""The model's linear layers through oneDNN on the CPU: the same fp32 matrix products, faster than torch's
default route (`F.linear` -> MKL here), except the smallest inference products (SMALL_PRODUCT_MACS), where MKL is.

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

import contextlib
import functools
import os
from collections.abc import Iterable, Iterator
from contextvars import ContextVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as torch_module
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.weak import WeakIdKeyDictionary

ONEDNN_LINEAR = True  # benchmarks and tests flip it to time or compare torch's own route
# The route of training's products (forward and input gradient): "onednn" (OneDnnLinear) or "torch" (F.linear).
# Which is faster depends on the CPU: oneDNN on the AMD EPYC VM, MKL at ViT-B/16 size on the Intel Xeon VM. `vitlab
# train` measures it once per machine and product shapes (`train/products.py`), records the choice in the run and
# restores it on resume (exact resume needs the same kernels). Elsewhere (a user's own training loop) it is "auto":
# each ViT takes the route measured for its shapes at its first CPU fp32 training forward (timed once per machine,
# then cached; `VisionTransformer._training_products`), and oneDNN serves every other model.
TRAINING_PRODUCTS = "auto"
TRAINING_ROUTES = ("onednn", "torch")
_auto_route = "onednn"  # what "auto" stands for now: the route of the ViT whose training forward ran last


def set_training_products(route: str) -> None:
    if route not in (*TRAINING_ROUTES, "auto"):
        raise ValueError(f"training products route must be one of {(*TRAINING_ROUTES, 'auto')}, got {route!r}")
    global TRAINING_PRODUCTS
    TRAINING_PRODUCTS = route


def use_auto_route(route: str) -> None:
    """The route "auto" takes from now on (a ViT's own, measured; see TRAINING_PRODUCTS)."""
    if route not in TRAINING_ROUTES:
        raise ValueError(f"training products route must be one of {TRAINING_ROUTES}, got {route!r}")
    global _auto_route
    _auto_route = route


def onednn_training() -> bool:
    return (_auto_route if TRAINING_PRODUCTS == "auto" else TRAINING_PRODUCTS) == "onednn"


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will want a gradient through an op of these tensors (grad mode on, one of them requires it)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


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


# Inference products up to this size run through torch's own F.linear (MKL here) instead: oneDNN spends 15-20 us on
# a call before it multiplies, MKL a few. On the 2-core VM a 50 x 64 -> 192 product (the Fashion-MNIST ViT's qkv at
# batch 1) took about half the time through MKL; from about 4 million multiply-accumulates on oneDNN is as fast or
# faster, and products of one row (a class-token-only last block at batch 1) favour oneDNN's packed weights sooner.
# `python benchmarks/linear.py --small` (docs/results/linear_small_products.txt). The rule depends on the shape
# alone, as every route choice here does.
SMALL_PRODUCT_MACS = 4_000_000  # rows x in x out, products of SMALL_PRODUCT_MIN_ROWS rows or more
SMALL_FEW_ROW_PRODUCT_MACS = 200_000  # products of fewer rows
SMALL_PRODUCT_MIN_ROWS = 8


def product_within(rows: int, weight: torch.Tensor, limit: int, few_row_limit: int) -> bool:
    """Whether a product of `rows` rows with this (out, in) weight has at most `limit` multiply-accumulates, or
    `few_row_limit` where it has fewer than SMALL_PRODUCT_MIN_ROWS rows."""
    return rows * weight.numel() <= (limit if rows >= SMALL_PRODUCT_MIN_ROWS else few_row_limit)


def product_rows(x: torch.Tensor) -> int:
    """The rows of `x` as the left operand of a product over its last dimension (all leading dimensions as one)."""
    return x.numel() // x.shape[-1]


def small_product(rows: int, weight: torch.Tensor) -> bool:
    """Whether an inference product of `rows` rows with this (out, in) weight runs faster through F.linear."""
    return product_within(rows, weight, SMALL_PRODUCT_MACS, SMALL_FEW_ROW_PRODUCT_MACS)


def onednn_linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return ONEDNN_LINEAR and cpu_fp32_eager(x) and weight.dtype == torch.float32 and onednn_linear_available()


def onednn_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str = "none",
                   algorithm: str = "") -> torch.Tensor:
    """x @ weight.T + bias (then `act`) in one oneDNN call; weight is (out, in) as in nn.Linear."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, act, [], algorithm)


class OneDnnLinear(torch.autograd.Function):
    """F.linear with the forward and the input gradient through oneDNN, the weight gradient through `mm`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return onednn_product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = onednn_product(grad, weight.t(), None) if need_x else None  # grad @ weight
        grad_w, grad_b = weight_and_bias_gradients(grad, x, need_w, need_b and ctx.has_bias)
        return grad_x, grad_w, grad_b


def weight_and_bias_gradients(grad: torch.Tensor, x: torch.Tensor, need_w: bool,
                              need_b: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A linear layer's weight gradient (through torch's `mm`, faster than oneDNN for it) and bias gradient."""
    grad_2d = grad.reshape(-1, grad.shape[-1])
    grad_w = grad_2d.t().mm(x.reshape(-1, x.shape[-1])) if need_w else None
    return grad_w, grad_2d.sum(0) if need_b else None


class PackedWeights:
    """Inference copies of the linear weights in oneDNN's own blocked layout, made once instead of on every call.

    oneDNN reorders a plain (out, in) weight into its blocked layout inside each matrix product; for a whole ViT
    at batch 1 that is a second pass over every weight, from main memory. An inference engine owns one of these
    and activates it around its calls (`with packs.active(): ...`); the logits are the unpacked route's
    (benchmarks/packed_weights.py; docs/benchmarks.md). A copy costs the weights' memory once more while the
    engine lives (`packing_fits` decides whether it may). Each copy remembers its weight's storage and version,
    so a weight changed in place (an optimizer step, `load_state_dict`) or replaced is packed anew; writes
    through `.data` bypass version counting and are not seen.
    """

    def __init__(self) -> None:
        self._packs = WeakIdKeyDictionary()  # weight -> ((data_ptr, version), packed copy)

    def weight_for(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.packed(weight, product_rows(x))

    def packed(self, weight: torch.Tensor, rows: int) -> torch.Tensor:
        """The packed copy of `weight`, made for products of `rows` rows when it is first asked for (or changed). A
        convolution's (out, in, kh, kw) weight is packed as the (out, in * kh * kw) matrix of its patch product."""
        stamp = (weight.data_ptr(), weight._version)
        entry = self._packs.get(weight)
        if entry is None or entry[0] != stamp:
            entry = (stamp, torch.ops.mkldnn._reorder_linear_weight(weight.detach().flatten(1), rows))
            self._packs[weight] = entry
        return entry[1]

    def hand_over(self, weight: torch.Tensor, replacement: torch.Tensor) -> None:
        """Give `weight`'s packed copy to `replacement` (its shape-only stand-in on the meta device, once the plain
        copy is freed: DirectInference.keep_packed_only), which is then never packed anew."""
        entry = self._packs[weight]
        self._packs[replacement] = ((replacement.data_ptr(), replacement._version), entry[1])

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        token = _ACTIVE_PACKS.set(self)
        try:
            yield
        finally:
            _ACTIVE_PACKS.reset(token)


_ACTIVE_PACKS: ContextVar[PackedWeights | None] = ContextVar("vitlab_active_packed_weights", default=None)


@functools.cache
def packing_available() -> bool:
    return onednn_linear_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def available_memory_bytes() -> int | None:
    """What the OS says new allocations can still get (Linux's MemAvailable), or None where it cannot say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def packing_fits(model: nn.Module) -> bool:
    """Whether this torch can pack weights and a packed copy of the model's linear weights takes at most a quarter
    of the free memory: a second copy of ViT-H/14's weights is 2.5 GB, which a small machine should keep for the
    images instead."""
    if not packing_available():
        return False
    need = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))
    free = available_memory_bytes()
    return free is None or need <= free // 4


def _inference_weight(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The active engine's packed copy of `weight` (keyed by the parameter itself), else `weight` as the (out, in)
    matrix of its product (an nn.Linear's weight is that already; flatten(1) returns it unchanged)."""
    packs = _ACTIVE_PACKS.get()
    return weight.flatten(1) if packs is None else packs.weight_for(x, weight)


def _inference_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The inference route of `linear` and `product`: F.linear for the smallest products, else one oneDNN call."""
    plain = weight.flatten(1)
    if small_product(product_rows(x), plain):
        return F.linear(x, plain, bias)
    return onednn_product(x, _inference_weight(x, weight), bias)


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.flatten(1).T + bias for inference (no autograd) on the CPU in fp32, by `linear`'s inference route:
    F.linear for the smallest products, else one oneDNN call with the active engine's packed copy of the weight.
    For a weight that is not an nn.Linear's (a patch embedding's convolution, as a product of patches)."""
    if not (ONEDNN_LINEAR and onednn_linear_available()):
        return F.linear(x, weight.flatten(1), bias)
    return _inference_product(x, weight, bias)


def watched(modules: Iterable[nn.Module]) -> bool:
    """Whether a hook (forward or backward; on one of `modules`, or registered for every module) would see these
    modules run: a route that computes their operators directly instead of calling them would hide it."""
    if global_hooks():
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for m in modules)


def global_hooks() -> bool:
    """Whether a hook is registered for every module (forward or backward)."""
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
                or torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks)


def watched_apart_from(module: nn.Module, pre_hook) -> bool:
    """`watched((module,))` with one of its forward pre-hooks, `pre_hook`, not counted."""
    return (global_hooks() or bool(module._forward_hooks or module._backward_hooks or module._backward_pre_hooks)
            or any(hook is not pre_hook for hook in module._forward_pre_hooks.values()))


def module_tree(*roots: nn.Module) -> list[nn.Module]:
    """The roots and every module under them, each once: the modules `root.modules()` yields for each root, without
    the qualified names `modules()` builds on the way (the model's forward asks on every call)."""
    tree, seen, i = list(roots), set(map(id, roots)), 0
    while i < len(tree):
        for child in tree[i]._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                tree.append(child)
        i += 1
    return tree


def plain_layer(module: nn.Module, cls: type) -> bool:
    """Whether `module` is exactly a `cls` (not a subclass or a wrapper with a forward of its own, e.g. a LoRA layer
    that exposes its base layer's weight) and no hook watches it: only then does computing its operator directly
    give, and show, what `module(x)` would."""
    return type(module) is cls and not watched((module,))


def linear(x: torch.Tensor, fc: nn.Linear) -> torch.Tensor:
    """fc(x) by the fastest exact route for where it runs."""
    if not (plain_layer(fc, nn.Linear) and onednn_linear_applies(x, fc.weight)):
        return fc(x)
    if needs_grad(x, fc.weight, fc.bias):
        return OneDnnLinear.apply(x, fc.weight, fc.bias) if onednn_training() else F.linear(x, fc.weight, fc.bias)
    return _inference_product(x, fc.weight, fc.bias)


def linear_act(x: torch.Tensor, fc: nn.Linear, act: str, algorithm: str) -> torch.Tensor:
    """act(fc(x)) as one oneDNN call (inference only: the fused op has no backward); the caller checks that
    `plain_layer(fc, nn.Linear)` holds."""
    return onednn_product(x, _inference_weight(x, fc.weight), fc.bias, act, algorithm)
