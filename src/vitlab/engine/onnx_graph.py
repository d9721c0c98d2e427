"""ONNX graphs built for ONNX Runtime's transformer fusions (fused Attention, SkipLayerNorm, FastGelu).

ORT's attention fusion only matches separate q, k, v projections and `softmax(q @ k^T / sqrt(d)) @ v`
(../shared/reference/fast-inference.md, 2.2), so the export swaps each fused-qkv `Attention` for an
export-only copy written that way. The weights are the same numbers cut into three; the state-dict layout
of the model itself does not change.
"""

from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn.utils import skip_init

from vitlab.errors import VitlabError


class SplitQKVAttention(nn.Module):
    """Export-only attention: separate q, k, v projections and an explicit scaled softmax."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        dim = attn.qkv.in_features
        self.heads, self.head_dim = attn.heads, attn.head_dim
        # skip_init: no random initialisation to overwrite (it drew from the global generator of the user's program)
        self.q, self.k, self.v = (skip_init(nn.Linear, dim, dim, bias=attn.qkv.bias is not None) for _ in range(3))
        with torch.no_grad():
            for lin, w in zip((self.q, self.k, self.v), attn.qkv.weight.chunk(3, dim=0)):
                lin.weight.copy_(w)
            if attn.qkv.bias is not None:
                for lin, b in zip((self.q, self.k, self.v), attn.qkv.bias.chunk(3, dim=0)):
                    lin.bias.copy_(b)
        self.proj = attn.proj

    def forward(self, x: torch.Tensor, return_attention: bool = False,
                queries: int | None = None) -> tuple[torch.Tensor, None]:
        b, n, d = x.shape
        m = n if queries is None else queries  # the class-token-only last block projects that token's query alone
        q = self.q(x if queries is None else x[:, :m])  # no Slice node otherwise: ORT's fusion would not match
        q = q.reshape(b, m, self.heads, self.head_dim).permute(0, 2, 1, 3)
        k = self.k(x).reshape(b, n, self.heads, self.head_dim).permute(0, 2, 3, 1)
        v = self.v(x).reshape(b, n, self.heads, self.head_dim).permute(0, 2, 1, 3)
        probs = (torch.matmul(q, k) / math.sqrt(self.head_dim)).softmax(dim=-1)
        out = torch.matmul(probs, v).permute(0, 2, 1, 3).reshape(b, m, d)
        return self.proj(out), None


def fusable_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose ViT attention blocks use `SplitQKVAttention` (same function, same numbers). The
    modules are copied, the tensors shared (nothing here writes them): the export holds the weights once less (2.5
    GB at ViT-H/14)."""
    from vitlab.models.vit import Attention

    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}  # deepcopy's memo: these stay themselves
    twin = copy.deepcopy(model, shared).eval()
    for module in list(twin.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Attention):
                setattr(module, name, SplitQKVAttention(child))
    return twin


def trace_to_onnx(module: nn.Module, example: torch.Tensor, path: str | Path, output_names=("logits",),
                  opset: int = 17, dynamic_batch: bool = True) -> Path:
    """torch.onnx.export (TorchScript exporter: ORT's fusions are written for its graphs) with input `images`
    and a dynamic batch dimension on every input and output; the exporter's warnings are not for users."""
    import importlib.util

    if importlib.util.find_spec("onnx") is None:  # torch's own error read like a vitlab bug
        raise VitlabError("writing ONNX needs the onnx package: pip install 'vitlab[onnx]' (onnx and onnxruntime)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = ["images", *output_names]
    dynamic = {name: {0: "batch"} for name in names} if dynamic_batch else None
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), (example,), str(path), input_names=["images"],
                          output_names=list(output_names), dynamic_axes=dynamic, opset_version=opset, dynamo=False)
    return path


def export_fusable(model: nn.Module, path: str | Path, image_size: tuple[int, int], opset: int = 17) -> Path:
    """Write `model` as ONNX (input `images`, output `logits`, dynamic batch) in the fusable form."""
    return trace_to_onnx(fusable_copy(model), torch.zeros(1, model.config.in_chans, *image_size), path, opset=opset)
