"""ViT inference on the CPU as direct operator calls: what `VisionTransformer.forward` computes in eval mode,
without the Python of its module tree.

At batch 1 a ViT's blocks are many small operators, and the Python around each one (module calls, the per-layer
route checks of fast_linear and gelu, the packed-weight look-ups) adds up: about 2 ms of ViT-Ti/16's 25 ms per
image at batch 1 in one run on the 2-core VM of docs/benchmarks.md (1.04-1.10x in two runs;
`python benchmarks/direct_inference.py`, docs/results/direct_inference.txt). `DirectInference` reads each
block's parameters once into a flat plan (the linear weights packed into oneDNN's layout when it is given a
`PackedWeights`) and runs the operators the modules run, on the same tensors, in the same order: the same logits
to the last bit (tests/test_model_vit_direct.py). `--engine torch` owns one with packed weights; a model's own
`forward` (a user's `model(x)` under `torch.inference_mode()`) builds one that reads the live weights
(`VisionTransformer._direct_inference`).

It checks on every call that nothing would see a difference. A call it does not cover (autograd, another dtype or
device, autocast, the model in training mode or watched by a hook) returns None, and the caller runs the model.
Blocks it does not cover (a replaced or wrapped layer, e.g. LoRA's; a forward hook on a block or any layer of one;
a layer left in training mode; a layer class or layer whose forward was patched) run through their modules, and a
model whose `forward`, `_tokens` or `encode` is not VisionTransformer's own runs as it is. A replaced layer or
parameter, a weight changed in place (an optimizer step, `load_state_dict`) or a changed constant (LayerNorm eps,
heads, the GELU kind) makes it build the plan anew. Everything outside the blocks (patch embedding, class token
and position embeddings, final LayerNorm, head) runs through the model's own modules.
"""

from __future__ import annotations

import math
import operator
import weakref
from itertools import chain, repeat, starmap
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.errors import VitlabError
from vitlab.models import attention_core, fast_linear, gelu, threads
from vitlab.models.attention_core import inference_attention
from vitlab.models.fast_linear import PackedWeights
from vitlab.models.registry import forward_flops
from vitlab.models.vit import Attention, Block, DropPath, Mlp, VisionTransformer

DIRECT_INFERENCE = True  # tests and benchmarks flip it to compare with the module route

# The sub-layers a block may have for the plan to compute what it computes (dropouts are identities in eval mode).
_STANDARD = {
    "norm1": (nn.LayerNorm,), "norm2": (nn.LayerNorm,), "attn": (Attention,), "mlp": (Mlp,),
    "drop_path1": (nn.Identity, DropPath), "drop_path2": (nn.Identity, DropPath),
    "qkv": (nn.Linear,), "proj": (nn.Linear,), "proj_drop": (nn.Identity, nn.Dropout),
    "fc1": (nn.Linear,), "act": (nn.GELU,), "drop1": (nn.Identity, nn.Dropout), "fc2": (nn.Linear,),
    "drop2": (nn.Identity, nn.Dropout),
}


# The layers whose parameters the plan reads. A parameter given to another layer (a GELU, a dropout) changes
# nothing its forward computes, so their parameter dicts are not watched: one check fewer per layer and call.
_READ_PARAMETERS = ("norm1", "norm2", "qkv", "proj", "fc1", "fc2")


def _own_forward(cls: type):
    """cls.forward if the class defines it itself (or inherits nn.Module's), else None: patched before import."""
    forward = cls.forward
    own = forward.__module__ == cls.__module__ and forward.__qualname__.split(".")[0] == cls.__name__
    return forward if own else None


# The forwards the plan stands in for. A class patched at run time (`Attention.forward = my_forward`, as
# attention-map tools do) or one layer given its own forward would not run under the plan: such calls take the modules.
_FORWARDS = {cls: _own_forward(cls) for cls in {c for classes in _STANDARD.values() for c in classes} | {Block}}
# The model's own methods the direct call replaces (`encode`) or stands beside (`forward`, `_tokens`).
_MODEL_METHODS = ("forward", "_tokens", "encode")
# What a layer's own dict holds that makes the plan not apply: hooks, training mode (read per call, each pass in C)
_WATCHED = tuple(map(operator.itemgetter, ("_forward_hooks", "_forward_pre_hooks", "training")))
_VERSION = operator.attrgetter("_version")


class _BlockPlan(NamedTuple):
    """One block's tensors and constants, in the order `_block` uses them."""

    norm1: tuple  # (normalized_shape, weight, bias, eps)
    qkv_weight: tuple[torch.Tensor, torch.Tensor]  # (packed for oneDNN, or plain; plain), as `_block_plan` reads them
    qkv_bias: torch.Tensor | None
    heads: int
    proj_weight: tuple[torch.Tensor, torch.Tensor]
    proj_bias: torch.Tensor | None
    norm2: tuple
    fc1_weight: tuple[torch.Tensor, torch.Tensor]
    fc1_bias: torch.Tensor | None
    gelu: str  # the GELU's `approximate`: "tanh" (official) or "none"
    fc2_weight: tuple[torch.Tensor, torch.Tensor]
    fc2_bias: torch.Tensor | None


def _own_methods(model: VisionTransformer) -> bool:
    cls = type(model)
    return all(getattr(cls, name) is getattr(VisionTransformer, name) and name not in model.__dict__
               for name in _MODEL_METHODS)


_CLASSES, _CLASS_FORWARDS = list(_FORWARDS), list(_FORWARDS.values())
_FORWARD_OF = operator.attrgetter("forward")


def _patched(layer_dicts: list[dict]) -> bool:
    """Whether a layer's forward is not its class's as imported: patched on the class or given to the instance
    (`layer_dicts`: the layers' own `__dict__`s). A list compares its functions by identity."""
    return (list(map(_FORWARD_OF, _CLASSES)) != _CLASS_FORWARDS
            or any(map(dict.__contains__, layer_dicts, repeat("forward"))))


def _watched(layer_dicts: list[dict]) -> bool:
    """Whether a layer has a forward (pre-)hook or is in training mode."""
    return any(any(map(held, layer_dicts)) for held in _WATCHED)


def _layers(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """The block and every layer under it, named as in `_STANDARD` (the block itself as "block")."""
    mods = block._modules
    layers = [("block", block), *mods.items()]
    for name in ("attn", "mlp"):
        if name in mods:
            layers.extend(mods[name]._modules.items())
    return layers


def _norm(ln: nn.LayerNorm) -> tuple:
    return ln.normalized_shape, ln.weight, ln.bias, ln.eps


class _Built:
    """A plan and what it was built from. `_build` fills a new one, `seal`s it, and DirectInference swaps it in
    whole.

    Every call checks the plan against the model (`snapshot`, `_watched`, `_patched`), so those checks are written
    as passes that run in C (map, chain) over live views kept here. On the 2-core Intel Xeon VM, at batch 1 the
    check took 47-53 us back to back at ViT-Ti/16 against 76-125 as Python loops over every layer's dicts, and
    156-230 us against 154-254 right after a call, where the previous call's weights have pushed the few hundred
    objects it reads out of the caches (about 1 % of the call; 5 % at the Fashion-MNIST ViT, either way).
    `python benchmarks/direct_inference.py --plan-check` (docs/results/plan_check.txt)."""

    def __init__(self):
        self.plan: list[_BlockPlan] = []  # empty: not built yet, or the blocks are not the standard layers
        self.built_from: tuple = ()  # `snapshot()` when the plan was built
        self.dicts: list[dict] = []  # the module and parameter dicts the plan read
        self.held: list = []  # what those dicts held then: kept alive, so that no new object takes an old id
        self.layers: list[nn.Module] = []  # the blocks and their layers (hooks and training mode, per call)
        self.packed_from: list[torch.Tensor] = []  # the weights whose packed copies the plan holds
        self.constants: list[tuple[nn.Module, str]] = []  # (layer, attribute) the plan copied
        # set by `seal`: live views of the above for the per-call checks
        self.values: list = []  # each dict's values()
        self.layer_dicts: list[dict] = []  # each layer's own __dict__ (hooks, training, an instance's forward)

    def seal(self, plan: list[_BlockPlan]) -> None:
        """Take `plan` as the plan built from the model as it is now."""
        self.values = [d.values() for d in self.dicts]
        self.layer_dicts = [vars(m) for m in self.layers]
        self.held = list(chain.from_iterable(self.values))
        self.built_from = self.snapshot()
        self.plan = plan

    def snapshot(self) -> tuple:
        """What the plan depends on: which layers and parameters sit where (ids), the packed weights' data and
        versions (an in-place change, an optimizer step, `load_state_dict`), and the constants it copied. The
        other parameters (LayerNorms, biases) the plan reads as the live tensors."""
        return (list(map(id, chain.from_iterable(self.values))),
                list(map(torch.Tensor.data_ptr, self.packed_from)), list(map(_VERSION, self.packed_from)),
                list(starmap(getattr, self.constants)))


class DirectInference:
    """A ViT's CPU fp32 inference as direct operator calls (module docstring). `direct(images)` -> the logits of
    `model(images)`, or None where it does not apply; `packs` (optional) supplies the linear weights in oneDNN's
    layout."""

    def __init__(self, model: VisionTransformer, packs: PackedWeights | None = None, *, held_by_model: bool = False):
        # Held by the model itself (its own `model(x)` route): a weak reference, else the model and its plan would
        # form a cycle and a deleted model's weights would wait for Python's cyclic collector instead of going at once
        self._model = weakref.ref(model) if held_by_model else (lambda: model)
        self.packs = packs
        self._built = _Built()  # replaced whole when the plan is built anew, so a concurrent call sees one or the other
        self._guarded = False  # keep_packed_only freed the plain weights and put its guard on the model
        self._small_call_sizes: dict[tuple[int, int], tuple[float, int]] = {}  # image size -> (FLOPs, tokens)
        self._sized_config = None  # the model config those were counted for

    @property
    def model(self) -> VisionTransformer:
        return self._model()

    def __call__(self, images: torch.Tensor) -> torch.Tensor | None:
        model = self.model
        if not self.applies(images):
            return None
        x = model.embed(images)
        class_token_only = model._class_token_only(False)
        plan = self._current(x, class_token_only)
        if not plan:  # blocks that are not the standard layers, or watched by hooks: their modules run them
            if self._guarded:  # ... which would compute with the freed weights
                _refuse_freed_weights(model, ())
            return model.forward_head(model.encode(x, False, class_token_only)[0])
        last = len(plan) - 1
        fused_gelu = gelu.FAST_CPU_GELU
        for i, block in enumerate(plan):
            x = _block(x, block, 1 if class_token_only and i == last else None, fused_gelu)
        return model.forward_head(model.norm(x))

    def small_call(self, images: torch.Tensor) -> bool:
        """Whether `model(x)` runs this call on one thread (models/threads.py): at most ONE_THREAD_MAX_FLOPS, and
        few enough tokens that the attention route is the explicit one (attention_core.EXPLICIT_MAX_TOKENS), on one
        thread as on the caller's, so that the logits are the caller's to the last bit. Decided by the shape."""
        if images.dim() != 4 or images.device.type != "cpu" or torch.get_num_threads() == 1:
            return False
        flops, tokens = self.per_image(tuple(images.shape[-2:]))
        return images.shape[0] * flops <= threads.ONE_THREAD_MAX_FLOPS and tokens <= attention_core.EXPLICIT_MAX_TOKENS

    def per_image(self, size: tuple[int, int]) -> tuple[float, int]:
        """(forward FLOPs, tokens) of one image of this size for the model as it is now (`_flops_and_tokens`),
        counted once per size and model config: prune_intermediate_layers, set_input_size and the like replace
        the config, and the count is made anew."""
        config = self.model.config
        if config is not self._sized_config:
            self._small_call_sizes, self._sized_config = {}, config
        per_image = self._small_call_sizes.get(size)
        if per_image is None:
            per_image = self._small_call_sizes[size] = _flops_and_tokens(config, size)
        return per_image

    def applies(self, images: torch.Tensor) -> bool:
        """CPU fp32 eager inference (no autograd) of a ViT in eval mode whose forward no hook watches and whose
        forward, `_tokens` and `encode` are VisionTransformer's own (not overridden by a subclass or patched)."""
        model = self.model
        return (DIRECT_INFERENCE and isinstance(model, VisionTransformer) and not torch.is_grad_enabled()
                and not model.training and len(model.blocks) > 0 and _own_methods(model)
                and not (fast_linear.watched((model,)) and self._watched_by_others(model))
                and fast_linear.ONEDNN_LINEAR and fast_linear.onednn_linear_available()
                and fast_linear.cpu_fp32_eager(images))

    def _watched_by_others(self, model: VisionTransformer) -> bool:
        """Whether a hook watches the model, apart from the guard `keep_packed_only` put on it (which keeps every
        caller but this plan from computing with the freed weights)."""
        return not self._guarded or fast_linear.watched_apart_from(model, _refuse_freed_weights)

    def keep_packed_only(self) -> int:
        """Free the plain copy of every block weight whose products always run packed (`_may_run_plain`: no number
        of rows makes one of them small enough for F.linear), for an engine that owns the model and runs it only
        through this plan (TorchEngine.keep_packed_only): a second copy of the weights, 340 MB at ViT-B/16. Each
        such layer gets a stand-in on the meta device (the shape, without memory) that takes over the packed
        copy, so the plan stays valid; the model itself can no longer compute with those layers. Returns the
        bytes freed: none before the plan is built (the packed copies are made by the first call) or without
        packed weights."""
        built, packs = self._built, self.packs
        if packs is None or not built.plan:
            return 0
        stand_ins: dict[int, nn.Parameter] = {}  # id(plain weight) -> its stand-in
        with torch.inference_mode(False):  # ordinary tensors (a caller's inference mode would make them count nothing)
            plan = [p._replace(**_hand_over_weights(block, p, packs, stand_ins))
                    for block, p in zip(self.model.blocks, built.plan)]
        if not stand_ins:
            return 0
        freed = sum(w.numel() * w.element_size() for w in built.packed_from if id(w) in stand_ins)
        built.packed_from = [stand_ins.get(id(w), w) for w in built.packed_from]
        built.seal(plan)  # the per-call checks now watch the stand-ins
        model = self.model
        # the model's own `model(x)` route may hold a plan of its own that reads the old weights: dropped with them
        model.__dict__.pop("_direct", None)
        # A product with a meta weight on the CPU does not fail: F.linear returns garbage. So the model refuses
        # every call but this plan's (the guard is a hook: the model's own direct route steps aside for it)
        model.register_forward_pre_hook(_refuse_freed_weights)
        self._guarded = True
        return freed

    # ------------------------------------------------------------------------------------ the plan
    def _current(self, x: torch.Tensor, class_token_only: bool) -> list[_BlockPlan]:
        """The plan for the blocks as they are now; empty where they are not the standard layers, or where a
        forward hook watches one of them or one is in training mode."""
        built = self._built
        if not built.dicts or built.snapshot() != built.built_from:
            built = self._built = self._build(x, class_token_only)
        if not built.plan or _watched(built.layer_dicts) or _patched(built.layer_dicts):
            return []
        return built.plan

    def _build(self, x: torch.Tensor, class_token_only: bool) -> _Built:
        blocks = self.model.blocks
        built = _Built()
        # the model's own layers too: `model.blocks = ...` (prune_intermediate_layers slices it into a new list)
        # leaves the old list's dict as it was, and the plan would go on running the old blocks
        built.dicts.extend([self.model._modules, blocks._modules])
        plans = []
        # a weight is packed for the rows of the product it first serves, as the module route packs it: B x N, and B
        # for the products after the attention of a class-token-only last block
        rows = x.shape[0] * x.shape[1]
        last_rows = x.shape[0] if class_token_only else rows
        for i, block in enumerate(blocks):
            layers = _layers(block)
            built.layers.extend(m for _, m in layers)
            built.dicts.extend(m._modules for name, m in layers if name in ("block", "attn", "mlp"))
            built.dicts.extend(m._parameters for name, m in layers if name in _READ_PARAMETERS)
            standard = type(block) is Block and all(name == "block" or type(m) in _STANDARD.get(name, ())
                                                    for name, m in layers)
            if not standard or any(p.dtype != torch.float32 or p.device.type != "cpu" for p in block.parameters()):
                plans = []
                break
            plans.append(self._block_plan(built, block, rows, last_rows if i == len(blocks) - 1 else rows))
        built.seal(plans)
        return built

    def _block_plan(self, built: _Built, block: Block, rows: int, rows_after_attention: int) -> _BlockPlan:
        attn, mlp, norm1, norm2 = block.attn, block.mlp, block.norm1, block.norm2
        built.constants.extend([(norm1, "eps"), (norm1, "normalized_shape"), (norm2, "eps"),
                                (norm2, "normalized_shape"), (attn, "heads"),
                                (mlp.act, "approximate")])

        def weight(fc: nn.Linear, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
            if self.packs is None:
                return fc.weight, fc.weight
            built.packed_from.append(fc.weight)
            return self.packs.packed(fc.weight, rows), fc.weight

        later = rows_after_attention
        return _BlockPlan(
            _norm(norm1), weight(attn.qkv, rows), attn.qkv.bias, attn.heads,
            weight(attn.proj, later), attn.proj.bias, _norm(norm2), weight(mlp.fc1, later), mlp.fc1.bias,
            mlp.act.approximate, weight(mlp.fc2, later), mlp.fc2.bias,
        )


def _flops_and_tokens(config, size: tuple[int, int]) -> tuple[float, int]:
    """(forward FLOPs, tokens) of one image of this size; infinite FLOPs for a size the model does not take (the
    call then fails in the model's own words, on the caller's threads)."""
    try:
        grid = config.grid_for(size)
        return forward_flops(config, size), grid[0] * grid[1] + config.num_prefix_tokens
    except VitlabError:
        return math.inf, 0


def _refuse_freed_weights(model: nn.Module, _args) -> None:
    raise VitlabError("this model's linear weights were freed once its torch engine held them packed for oneDNN "
                      "(engine.release); only that engine can run it: load the model again to run it otherwise")


def _may_run_plain(weight: torch.Tensor) -> bool:
    """Whether some product with this weight (by row count) takes `_linear`'s or `_fc1_gelu`'s plain route. The
    fewest rows of each regime (1, and fast_linear.SMALL_PRODUCT_MIN_ROWS) give its smallest products."""
    return any(fast_linear.small_product(rows, weight) or gelu.small_gelu_product(rows, weight)
               for rows in (1, fast_linear.SMALL_PRODUCT_MIN_ROWS))


def _hand_over_weights(block: Block, p: _BlockPlan, packs: PackedWeights,
                       stand_ins: dict[int, nn.Parameter]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """For `keep_packed_only`: replace each of the block's linear weights that always runs packed by a meta
    stand-in holding its packed copy (recorded in `stand_ins`); returns the plan fields to change."""
    fields = {}
    layers = {"qkv_weight": block.attn.qkv, "proj_weight": block.attn.proj,
              "fc1_weight": block.mlp.fc1, "fc2_weight": block.mlp.fc2}
    for field, fc in layers.items():
        packed, plain = getattr(p, field)
        if packed is plain or plain is not fc.weight or plain.is_meta or _may_run_plain(plain):
            continue
        stand_in = nn.Parameter(torch.empty_like(plain, device="meta"), requires_grad=plain.requires_grad)
        packs.hand_over(plain, stand_in)
        fc.weight = stand_in
        stand_ins[id(plain)] = stand_in
        fields[field] = (packed, stand_in)
    return fields


def _linear(x: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    """fast_linear.linear's inference route: F.linear for the smallest products, else one oneDNN call."""
    onednn, plain = weights
    if fast_linear.small_product(fast_linear.product_rows(x), plain):
        return F.linear(x, plain, bias)
    return torch.ops.mkldnn._linear_pointwise.default(x, onednn, bias, "none", [], "")


def _fc1_gelu(h: torch.Tensor, p: _BlockPlan, fused_gelu: bool) -> torch.Tensor:
    """The GELU of fc1, as gelu.linear_gelu computes it in inference: the official tanh GELU in fc1's oneDNN call,
    except for the smallest products (F.linear, then torch's GELU, as for the erf GELU)."""
    if p.gelu == "tanh" and fused_gelu and not gelu.small_gelu_product(fast_linear.product_rows(h), p.fc1_weight[1]):
        return torch.ops.mkldnn._linear_pointwise.default(h, p.fc1_weight[0], p.fc1_bias, "gelu", [], "tanh")
    return F.gelu(_linear(h, p.fc1_weight, p.fc1_bias), approximate=p.gelu)


def _block(x: torch.Tensor, p: _BlockPlan, queries: int | None, fused_gelu: bool) -> torch.Tensor:
    """`Block.forward` in eval mode (Attention.forward, Mlp.forward), operator for operator."""
    out = inference_attention(_linear(F.layer_norm(x, *p.norm1), p.qkv_weight, p.qkv_bias), p.heads, queries)
    if queries is not None:
        x = x[:, :queries]
    x = x + _linear(out, p.proj_weight, p.proj_bias)
    h = _fc1_gelu(F.layer_norm(x, *p.norm2), p, fused_gelu)
    return x + _linear(h, p.fc2_weight, p.fc2_bias)
