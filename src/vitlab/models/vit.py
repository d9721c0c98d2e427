"""The Vision Transformer of the paper (Eq. 1-4), numerically as the official Flax code.

Key names follow timm, so timm and torchvision weights map 1:1 and our checkpoints load in timm.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from vitlab.errors import VitlabError
from vitlab.models import fast_linear
from vitlab.models.attention_core import attention, explicit_attention, inference_attention
from vitlab.models.config import ViTConfig
from vitlab.models.convstem import ConvStem
from vitlab.models.fast_linear import linear, watched
from vitlab.models.gelu import mlp
from vitlab.models.posemb import resample_posemb, sincos_2d
from vitlab.models.resnet import ResNetBody, lecun_normal_
from vitlab.models.surface import (
    TimmSurface,
    check_output_fmt,
    feature_take_indices,
    tokens_to_maps,
    update_preprocess_size,
)
from vitlab.models.threads import one_thread

# The logits of a class-token ViT read only the class token, so the last block computes that token alone: its
# attention, MLP and the final LayerNorm for 1 row instead of N, the same numbers for that row (every token still
# serves as a key and value). ViT-B/16 at 224 px: 76 % of the last block's work, 6 % of the model's.
CLASS_TOKEN_ONLY = True  # tests and benchmarks flip it to compare with the full last block
PATCH_PRODUCT = True  # tests and benchmarks flip it to compare with the convolution (PatchEmbed._inference_product)

class PatchEmbed(nn.Module):
    """Patches -> tokens with one strided convolution; hybrids first run a CNN (BiT ResNet body or conv stem)."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.patch_size = config.patch_size
        self.grid_for = config.grid_for
        self.backbone = ResNetBody(config.resnet, config.in_chans) if config.resnet is not None else None
        self.stem = ConvStem(config.in_chans, config.conv_stem) if config.conv_stem else None
        in_chans = self.cnn.out_channels if self.cnn is not None else config.in_chans
        self.proj = nn.Conv2d(in_chans, config.dim, config.patch_size, stride=config.patch_size)

    @property
    def cnn(self) -> nn.Module | None:
        """The hybrid's CNN (BiT ResNet body or conv stem), None for a plain ViT."""
        return self.backbone if self.backbone is not None else self.stem

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Returns tokens (B, h*w, D) and the grid (h, w)."""
        try:
            self.grid_for(tuple(x.shape[-2:]))
        except VitlabError as e:
            raise VitlabError(f"input {e}; resize or crop the images") from None
        if self.cnn is not None:
            return self._project_as_matmul(self.cnn(x))
        if self._inference_product(x):
            return self._project_as_matmul(x, inference=True)
        x = self.proj(x)
        grid = (x.shape[-2], x.shape[-1])
        return x.flatten(2).transpose(1, 2), grid

    def _inference_product(self, x: torch.Tensor) -> bool:
        """Whether to run the patch convolution as a product of patches: CPU fp32 eager inference (no autograd),
        the convolution not replaced or watched by a hook, and a shape where the product is the faster
        (`_product_faster`). The two differ in the last bits (summation order), as any two matrix-product kernels
        do; training, exports and compiled graphs keep the convolution."""
        proj = self.proj
        grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                for t in (x, proj.weight, proj.bias))
        return (PATCH_PRODUCT and not grads and fast_linear.cpu_fp32_eager(x)
                and fast_linear.plain_layer(proj, nn.Conv2d) and proj.weight.dtype == torch.float32
                and _patch_convolution(proj, self.patch_size) and _product_faster(x, self.patch_size))

    def _project_as_matmul(self, x: torch.Tensor,
                           inference: bool | None = None) -> tuple[torch.Tensor, tuple[int, int]]:
        """The same projection as `self.proj` (kernel = stride), written as cut-into-patches + one matmul.

        On the wide feature maps of a hybrid stem oneDNN's strided convolution is slower: for the
        one-convolution Fashion-MNIST hybrid (64 x 28 x 28 -> 7 x 7 patches) forward + backward took 19.8 vs 19.0 ms per
        32 images and 93.7 vs 80.6 ms per 128 (`python benchmarks/train_parts.py --threads 1 --rounds 20`).
        The weight keeps the convolution's (D, C, P, P) layout, so checkpoints do not change. In inference on the CPU
        the product takes `fast_linear.product`'s route (oneDNN with the engine's packed weight); `inference` is
        `_inference_product(x)` where the caller has already decided it.
        """
        b, c, height, width = x.shape
        p = self.patch_size
        h, w = height // p, width // p
        patches = x.reshape(b, c, h, p, w, p).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w, c * p * p)
        weight, bias = self.proj.weight, self.proj.bias
        if self._inference_product(x) if inference is None else inference:
            return fast_linear.product(patches, weight, bias), (h, w)
        return F.linear(patches, weight.reshape(weight.shape[0], -1), bias), (h, w)


# oneDNN's strided convolution is slower than the same projection as a product of patches (the cut copies the
# image once) for 32-pixel patches at any batch and for any patch at batch 1: ViT-B/32 4.8 against 1.4 ms at batch
# 1 and 1.21-1.32x at batch 32-64, ViT-Ti/16 1.11x and ViT-B/16 1.15x at batch 1, the Fashion-MNIST ViT 1.72x. For
# 16-pixel patches from 4 images on the convolution is as fast or faster (0.86-0.94x at ViT-Ti/16, 4-16 images).
# `python benchmarks/patch_embed.py` (docs/results/patch_embed.txt).
PATCH_PRODUCT_MIN_PATCH = 32
PATCH_PRODUCT_MAX_ROWS = 256  # patches of the whole batch: a 224-px image in 16-px patches has 196, 14-px 256


def _product_faster(x: torch.Tensor, patch: int) -> bool:
    rows = x.shape[0] * (x.shape[-2] // patch) * (x.shape[-1] // patch)
    return patch >= PATCH_PRODUCT_MIN_PATCH or rows <= PATCH_PRODUCT_MAX_ROWS


def _patch_convolution(conv: nn.Conv2d, patch: int) -> bool:
    """Whether `conv` is exactly a cut into patches and a product: kernel = stride = patch, no padding or groups."""
    return (conv.kernel_size == conv.stride == (patch, patch) and conv.padding == (0, 0)
            and conv.dilation == (1, 1) and conv.groups == 1)


def _intermediates_dict(maps: list[torch.Tensor], prefix: list[torch.Tensor] | None,
                        final: torch.Tensor | None) -> dict:
    """timm's `output_dict=True` answer: 'image_intermediates', with 'image_intermediates_prefix' and
    'image_features' where asked for."""
    out: dict = {"image_intermediates": maps}
    if prefix is not None:
        out["image_intermediates_prefix"] = prefix
    if final is not None:
        out["image_features"] = final
    return out


def _dropout(p: float) -> nn.Module:
    """Dropout, or a plain identity when the rate is 0 (no per-call cost at inference)."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection (rows ordered q, k, v; heads contiguous)."""

    def __init__(self, dim: int, heads: int, qkv_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = _dropout(proj_drop)

    def forward(self, x: torch.Tensor, return_attention: bool = False,
                queries: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Self-attention of x (B, N, D); with `queries` only the first that many tokens attend (over all N)."""
        if not (self.training or return_attention):
            return self.proj_drop(linear(inference_attention(linear(x, self.qkv), self.heads, queries), self.proj)), None
        b, n, d = x.shape
        # Split the fused projection along features, then (B, N, H, hd) -> (B, H, N, hd) views: SDPA takes
        # these strides as they are, where a permute of (B, N, 3, H, hd) made it copy (and the backward
        # stack). Attention fwd+bwd, width-64 ViT (128 images) 28.2 -> 24.7 ms, ViT-Ti/16 (16) 62.7 -> 57.2 ms
        # (`python benchmarks/train_parts.py --threads 1 --rounds 20`).
        q, k, v = (t.reshape(b, n, self.heads, self.head_dim).transpose(1, 2) for t in linear(x, self.qkv).chunk(3, dim=-1))
        if queries is not None:
            q, n = q[:, :, :queries], queries
        drop = self.attn_drop if self.training else 0.0
        attn = None
        if return_attention:
            # Same weights, explicit softmax: the probabilities are what the fused kernel computes.
            out, attn = explicit_attention(q, k, v, drop, self.training)
        else:
            out = attention(q, k, v, drop)
        out = out.transpose(1, 2).reshape(b, n, d)
        return self.proj_drop(linear(out, self.proj)), attn


class Mlp(nn.Module):
    """Dense -> GELU -> Dropout -> Dense -> Dropout (the official MlpBlock)."""

    def __init__(self, dim: int, hidden: int, gelu: str = "tanh", drop: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh" if gelu == "tanh" else "none")
        self.drop1 = _dropout(drop)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop2 = _dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(mlp(x, self.fc1, self.act, self.drop1, self.fc2))


class DropPath(nn.Module):
    """Stochastic depth: drops the whole residual branch per sample while training."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
        return x * mask / keep

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Block(nn.Module):
    """Pre-LN encoder block: x + MSA(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, config: ViTConfig, drop_path: float = 0.0):
        super().__init__()
        eps = config.layer_norm_eps
        self.norm1 = nn.LayerNorm(config.dim, eps=eps)
        self.attn = Attention(config.dim, config.heads, config.qkv_bias, config.attention_dropout, config.dropout)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(config.dim, eps=eps)
        self.mlp = Mlp(config.dim, config.mlp_dim, config.gelu, config.dropout)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, return_attention: bool = False,
                queries: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block on x (B, N, D); with `queries` only the first that many tokens are computed (B, queries, D),
        each attending over all N as in the full block."""
        y, attn = self.attn(self.norm1(x), return_attention, queries)
        if queries is not None:
            x = x[:, :queries]
        x = x + self.drop_path1(y)
        x = x + self.drop_path2(self.mlp(self.norm2(x)))
        return x, attn


class AttentionPool(nn.Module):
    """big_vision's MAP head: a learned probe attends over the tokens, then LN + MLP residual."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        d = config.dim
        self.heads = config.heads
        self.latent = nn.Parameter(torch.zeros(1, 1, d))
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.mlp = Mlp(d, config.mlp_dim, config.gelu)

    def _query_keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The probe's query (B, heads, 1, hd) and the tokens' keys and values (B, heads, N, hd)."""
        b, n, d = x.shape
        hd = d // self.heads
        q = self.q(self.latent.expand(b, -1, -1)).reshape(b, 1, self.heads, hd).transpose(1, 2)
        k, v = self.kv(x).reshape(b, n, 2, self.heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape
        q, k, v = self._query_keys_values(x)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, 1, d)
        out = self.proj(out)
        out = out + self.mlp(self.norm(out))
        return out[:, 0]

    def probe_attention(self, x: torch.Tensor) -> torch.Tensor:
        """The probe's attention over the tokens x (B, N, D) -> (B, heads, N): the weights `forward` mixes their
        values with (softmax(q k^T / sqrt(hd)), as the fused kernel computes it), for inspection."""
        q, k, _ = self._query_keys_values(x)
        return (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(dim=-1)[:, :, 0]


class RepresentationLayer(nn.Module):
    """The paper's pre-training head hidden layer: Linear + tanh (`pre_logits`)."""

    def __init__(self, dim: int, size: int):
        super().__init__()
        self.fc = nn.Linear(dim, size)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class VisionTransformer(TimmSurface, nn.Module):
    """ViT (and R+ViT hybrids). `model(x)` -> logits; `model(x, return_attention=True)` -> (logits, attentions)."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        if config.arch != "vit":
            raise VitlabError(f"VisionTransformer needs arch='vit', got {config.arch!r}")
        self.config = config
        d = config.dim
        self.patch_embed = PatchEmbed(config)
        self.num_prefix_tokens = config.num_prefix_tokens
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d)) if config.classifier == "token" else None
        n_pos = config.grid_size[0] * config.grid_size[1] + self.num_prefix_tokens
        if config.posemb == "learn":
            self.pos_embed = nn.Parameter(torch.zeros(1, n_pos, d))
        else:
            self.register_buffer("pos_embed", None, persistent=False)
            self.compute_unstored_buffers()
        self.pos_drop = _dropout(config.dropout)
        rates = [config.drop_path * i / max(config.depth - 1, 1) for i in range(config.depth)]
        self.blocks = nn.ModuleList([Block(config, rate) for rate in rates])
        self.norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.attn_pool = AttentionPool(config) if config.classifier == "map" else None
        self.pre_logits = RepresentationLayer(d, config.representation_size) if config.representation_size else None
        self.num_features = config.representation_size or d
        self.head = nn.Linear(self.num_features, config.num_classes) if config.num_classes > 0 else nn.Identity()
        self.grad_checkpointing = False
        if not self.norm.weight.is_meta:  # a build for loading (`registry.build_unfilled`) has nothing to initialise
            self.init_weights()

    # ----------------------------------------------------------------------------------- init
    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise exactly as the official code (reference section 1.3)."""
        cfg = self.config
        if self.patch_embed.backbone is not None:
            from vitlab.models.resnet import init_resnet_

            init_resnet_(self.patch_embed.backbone)
        if self.patch_embed.stem is not None:
            self.patch_embed.stem.init_weights()
        lecun_normal_(self.patch_embed.proj.weight)
        nn.init.zeros_(self.patch_embed.proj.bias)
        if self.cls_token is not None:
            nn.init.zeros_(self.cls_token)
        if isinstance(self.pos_embed, nn.Parameter):
            nn.init.normal_(self.pos_embed, std=0.02)
        for block in self.blocks:
            # q, k and v are separate DenseGenerals in flax: xavier-uniform each (D x D) slice.
            for w in block.attn.qkv.weight.chunk(3, dim=0):
                nn.init.xavier_uniform_(w)
            if block.attn.qkv.bias is not None:
                nn.init.zeros_(block.attn.qkv.bias)
            nn.init.xavier_uniform_(block.attn.proj.weight)
            nn.init.zeros_(block.attn.proj.bias)
            self._init_mlp(block.mlp)
        for norm in [m for m in self.modules() if isinstance(m, nn.LayerNorm)]:
            nn.init.ones_(norm.weight)
            nn.init.zeros_(norm.bias)
        if self.attn_pool is not None:
            bound = math.sqrt(6.0 / (1 + cfg.dim))  # flax xavier on a (1, 1, D) probe
            nn.init.uniform_(self.attn_pool.latent, -bound, bound)
            for lin in (self.attn_pool.q, self.attn_pool.proj):
                nn.init.xavier_uniform_(lin.weight)
                nn.init.zeros_(lin.bias)
            for w in self.attn_pool.kv.weight.chunk(2, dim=0):
                nn.init.xavier_uniform_(w)
            nn.init.zeros_(self.attn_pool.kv.bias)
            self._init_mlp(self.attn_pool.mlp)
        if self.pre_logits is not None:
            lecun_normal_(self.pre_logits.fc.weight)
            nn.init.zeros_(self.pre_logits.fc.bias)
        if isinstance(self.head, nn.Linear):
            nn.init.zeros_(self.head.weight)
            nn.init.constant_(self.head.bias, cfg.head_bias_init)

    @staticmethod
    def _init_mlp(mlp: Mlp) -> None:
        for lin in (mlp.fc1, mlp.fc2):
            nn.init.xavier_uniform_(lin.weight)
            nn.init.normal_(lin.bias, std=1e-6)

    def compute_unstored_buffers(self) -> None:
        """(Re)compute what the model holds but never stores: the fixed sin-cos position table. Also what makes a
        model built on the meta device (`registry.build_unfilled`) whole once its stored weights are put in."""
        if self.config.posemb != "learn":
            self.pos_embed = self._sincos(self.config.grid_size)

    def _sincos(self, grid: tuple[int, int]) -> torch.Tensor:
        pe = sincos_2d(grid, self.config.dim)
        if self.num_prefix_tokens:
            pe = torch.cat([torch.zeros(1, self.num_prefix_tokens, self.config.dim), pe], dim=1)
        return pe

    # -------------------------------------------------------------------------------- forward
    def _pos_embed_for(self, grid: tuple[int, int]) -> torch.Tensor:
        """Position embeddings for a token grid; resampled on the fly if it is not the trained grid."""
        if tuple(grid) == self.config.grid_size:
            return self.pos_embed
        if self.config.posemb == "sincos2d":
            return self._sincos(grid).to(self.pos_embed)
        return resample_posemb(
            self.pos_embed, grid, self.config.grid_size, self.num_prefix_tokens, self.config.posemb_resample
        )

    def _class_token_only(self, return_attention: bool) -> bool:
        """Whether forward may compute the last block for the class token alone (see CLASS_TOKEN_ONLY)."""
        return (CLASS_TOKEN_ONLY and self.config.classifier == "token" and not return_attention and len(self.blocks) > 0
                # hooks there (feature extractors, Grad-CAM) get the full tokens
                and not watched(fast_linear.module_tree(self.blocks[-1], self.norm)))

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> the first block's input (B, N, D): patch tokens, class token, position embeddings."""
        self._check_images(x)
        if self.training:  # every forward path starts here
            self._training_products(x)
        x, grid = self.patch_embed(x)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        return self.pos_drop(x + self._pos_embed_for(grid))

    def _tokens(self, x: torch.Tensor, return_attention: bool,
                class_token_only: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.encode(self.embed(x), return_attention, class_token_only)

    def encode(self, x: torch.Tensor, return_attention: bool = False,
               class_token_only: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The blocks and the final LayerNorm on embedded tokens (B, N, D) -> (tokens, attention maps); with
        `class_token_only` the last block computes the class token alone (see CLASS_TOKEN_ONLY)."""
        attentions = []
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            queries = 1 if class_token_only and i == last else None
            if self.grad_checkpointing and self.training and not return_attention and torch.is_grad_enabled():
                x, _ = checkpoint(block, x, False, queries, use_reentrant=False)
            else:
                x, attn = block(x, return_attention, queries)
                if attn is not None:
                    attentions.append(attn)
        return self.norm(x), attentions

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (B, N, D) after the final LayerNorm."""
        return self._tokens(x, False)[0]

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.config.classifier == "token":
            return tokens[:, 0]
        if self.config.classifier == "gap":
            return tokens.mean(dim=1)
        return self.attn_pool(tokens)

    def forward_head(self, tokens: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Pool, representation layer (if any), head. `pre_logits=True` stops before the head."""
        x = self.pool(tokens)
        if self.pre_logits is not None:
            x = self.pre_logits(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor, return_attention: bool = False):
        if not return_attention:
            logits = self._direct_inference(x)
            if logits is not None:
                return logits
        tokens, attentions = self._tokens(x, return_attention, self._class_token_only(return_attention))
        logits = self.forward_head(tokens)
        return (logits, attentions) if return_attention else logits

    def _direct_inference(self, x: torch.Tensor) -> torch.Tensor | None:
        """The logits of CPU fp32 inference as direct operator calls (models/vit_direct.py: the same operators on the
        same tensors, so the same logits to the bit, without the module tree's Python: 1.12x at ViT-Ti/16, batch 1,
        in docs/benchmarks.md), or None where that route does not apply (autograd, training mode, hooks, patched
        layers, another device or dtype...). Built on the first call that may use it; it reads the live weights
        (nothing packed)."""
        if self.training or torch.is_grad_enabled():  # the common training call returns before anything else
            return None
        if torch.compiler.is_compiling() or torch.jit.is_tracing():  # graphs take the modules (and trace nothing here)
            return None
        direct = self.__dict__.get("_direct")
        if direct is None or direct.model is not self:  # not built yet, or another model's (a __dict__ copied in)
            from vitlab.models.vit_direct import DirectInference  # vit_direct imports this module

            direct = self.__dict__["_direct"] = DirectInference(self, held_by_model=True)
        if direct.small_call(x):  # little arithmetic: on one thread, this OS thread's alone (models/threads.py)
            with one_thread(process_wide_fallback=False):
                return direct(x)
        return direct(x)

    def _training_products(self, x: torch.Tensor) -> None:
        """Under fast_linear.TRAINING_PRODUCTS "auto" (a user's own training loop; `vitlab train` sets its route
        itself): the route of this model's CPU fp32 training products, measured at its first training forward for
        its shapes at this micro-batch (train/products.py: timed once per machine, then cached; F.linear where at
        least 5 % faster, else oneDNN), kept for the model's life, so a smaller last batch or a resumed loop in the
        same process keeps the kernels it started with."""
        if fast_linear.TRAINING_PRODUCTS != "auto" or not torch.is_grad_enabled() or not fast_linear.cpu_fp32_eager(x):
            return
        route = self.__dict__.get("_products_route")
        if route is None:
            from vitlab.train.products import resolve_products  # models stay importable without the trainer

            route = self.__dict__["_products_route"] = resolve_products("auto", x.device, "fp32", self, x.shape[0])
        fast_linear.use_auto_route(route)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_direct", None)  # rebuilt on use: pickles and deep copies carry no plan of the old model
        state.pop("_products_route", None)  # measured again where the copy trains (another machine, maybe)
        return state

    # -------------------------------------------------------------------- intermediate features
    output_formats = ("NCHW", "NLC")  # patch tokens as maps (B, D, h, w) or as tokens (B, h*w, D)

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None,
                              return_prefix_tokens: bool = False, norm: bool = False, stop_early: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False, output_dict: bool = False,
                              attn_mask: torch.Tensor | None = None, is_causal: bool = False):
        """timm's `forward_intermediates`: the outputs of the blocks in `indices` (None: all; n: the last n; a
        list, negative from the end), as maps (B, D, h, w) ('NCHW') or tokens (B, h*w, D) ('NLC'), the prefix
        (class) token split off; `norm` puts each through the final LayerNorm. Returns (forward_features(x),
        intermediates), the intermediates alone, or timm's dict. Hybrids take theirs from the blocks too, as timm's."""
        check_output_fmt(output_fmt, self.output_formats)
        if attn_mask is not None or is_causal:
            raise VitlabError("attn_mask / is_causal: vitlab's ViT attends over all tokens (no masking); leave "
                              "them out")
        take, last = feature_take_indices(len(self.blocks), indices)
        images, x = x, self.embed(x)  # embed checks the images first, with its own messages
        grid = self.patch_embed.grid_for(tuple(images.shape[-2:]))
        blocks = self.blocks[:last + 1] if stop_early else self.blocks
        taken = []
        for i, block in enumerate(blocks):
            x = self._run_block(block, x)
            if i in take:
                taken.append(self.norm(x) if norm else x)
        prefix = [t[:, :self.num_prefix_tokens] for t in taken] if self.num_prefix_tokens else None
        patches = [t[:, self.num_prefix_tokens:] for t in taken]
        if output_fmt == "NCHW":
            patches = tokens_to_maps(patches, grid)
        final = None if intermediates_only else self.norm(x)
        if output_dict:
            return _intermediates_dict(patches, prefix if return_prefix_tokens else None, final)
        if return_prefix_tokens and prefix is not None:
            patches = list(zip(patches, prefix))
        return patches if intermediates_only else (final, patches)

    def _run_block(self, block: Block, x: torch.Tensor) -> torch.Tensor:
        """One block on the full tokens, under activation checkpointing where `encode` would use it."""
        if self.grad_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(block, x, False, None, use_reentrant=False)[0]
        return block(x)[0]

    def prune_intermediate_layers(self, indices: int | list[int] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """timm's: drop the blocks after the last of `indices` (the config's depth follows), the final LayerNorm
        with `prune_norm`, the head (and representation layer) with `prune_head`; returns the indices kept."""
        take, last = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[:last + 1]
        self.config = self.config.replace(depth=last + 1)
        if prune_head:
            self.reset_classifier(0)
        if prune_norm:
            self.norm = nn.Identity()
        return take

    @property
    def feature_info(self) -> list[dict]:
        """timm's `feature_info`: one entry per block (its module, width, and pixels per token)."""
        return [{"module": f"blocks.{i}", "num_chs": self.config.dim, "reduction": self.config.stride}
                for i in range(len(self.blocks))]

    # ------------------------------------------------------------------------------ utilities
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute block activations in the backward pass to save memory."""
        self.grad_checkpointing = enable

    @property
    def num_classes(self) -> int:
        """The head's outputs (timm's attribute; 0: no head)."""
        return self.config.num_classes

    def get_classifier(self) -> nn.Module:
        """The classifier layer, as timm's `get_classifier()`."""
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None, *,
                         keep_representation: bool = False) -> None:
        """Fine-tuning surgery (paper B.1.1): drop the head (and the representation layer unless
        kept) and add a zero-initialised linear head with `num_classes` outputs.

        `global_pool` is timm's second argument; the pooling is fixed when the model is built, so only the
        model's own ('token', 'avg' for classifier='gap', 'map') is accepted, anything else is refused."""
        self._check_global_pool(global_pool)
        if not keep_representation and self.pre_logits is not None:
            self.pre_logits = None
            self.config = self.config.replace(representation_size=None)
        self.num_features = self.config.representation_size or self.config.dim
        ref = next(self.parameters())  # the final norm may be pruned (prune_intermediate_layers)
        self.head = nn.Linear(self.num_features, num_classes, device=ref.device, dtype=ref.dtype) if num_classes > 0 else nn.Identity()
        if isinstance(self.head, nn.Linear):
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)
        self.config = self.config.replace(num_classes=num_classes)
        self._forget_classes()

    @torch.no_grad()
    def set_image_size(self, image_size: int | tuple[int, int]) -> None:
        """Permanently resample the position embeddings to the grid of a new image size."""
        new_config = self.config.replace(image_size=image_size)
        self.preprocess = update_preprocess_size(self.preprocess, self.config.image_size, new_config.image_size)
        if new_config.grid_size == self.config.grid_size:
            self.config = new_config
            return
        if isinstance(self.pos_embed, nn.Parameter):
            new = resample_posemb(
                self.pos_embed.data, new_config.grid_size, self.config.grid_size,
                self.num_prefix_tokens, self.config.posemb_resample,
            )
            self.pos_embed = nn.Parameter(new)
            self.config = new_config
        else:
            self.config = new_config
            self.pos_embed = self._sincos(new_config.grid_size).to(self.pos_embed)

    def no_weight_decay(self) -> set[str]:
        """Parameters the paper's decoupled weight decay leaves alone (besides biases and norms)."""
        return {"cls_token", "pos_embed", "attn_pool.latent"}
