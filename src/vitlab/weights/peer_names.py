"""The peers' names for the paper's models, so that a timm or Hugging Face user can type what they know:

    timm architecture   vit_base_patch16_224, vit_large_patch32_384, vit_base_r50_s16_384  -> vit-b/16 at 224, ...
    timm checkpoint     vit_base_patch16_224.augreg_in21k_ft_in1k   -> vit-b/16.augreg-in21k-ft-in1k-224
    Hugging Face repo   google/vit-base-patch16-224                 -> vit-b/16.hf-in21k-ft-in1k-224

They name the same architectures, so they are aliases: the model built keeps vitlab's numerics, the official ones
(tanh GELU, where timm's own ViT computes the exact erf GELU); a timm or Hugging Face weights file read by
`vitlab.load` keeps its own. A peer name of an architecture vitlab does not build (CLIP, SigLIP, DeiT, register
tokens, timm's `_in21k` names of before its tags, ...) matches nothing here and fails as an unknown model.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_TIMM_SIZES = {"tiny": "ti", "small": "s", "base": "b", "large": "l", "huge": "h"}
_TIMM_VIT = re.compile(r"^vit_(tiny|small|base|large|huge)_patch(8|14|16|32)_(\d+)$")
# timm's hybrid entry points (vision_transformer_hybrid.py) -> vitlab's names; the suffix is the image size
_TIMM_HYBRIDS = {"vit_tiny_r_s16_p8": "r+vit-ti/16", "vit_small_r26_s32": "r26+vit-s/32",
                 "vit_base_r26_s32": "r26+vit-b/32", "vit_base_r50_s16": "r50+vit-b/16",
                 "vit_large_r50_s32": "r50+vit-l/32"}
_TIMM_HYBRID = re.compile(r"^(vit_[a-z0-9_]+)_(\d+)$")
_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class PeerName(NamedTuple):
    model: str  # vitlab's registry name
    image_size: int  # the resolution the name states
    tag: str | None  # timm's checkpoint tag ("augreg_in21k_ft_in1k"), or None for an architecture name


def timm_name(name: str) -> PeerName | None:
    """What a timm name of one of the paper's ViTs or hybrids means, or None where it is not one."""
    arch, dot, tag = name.strip().lower().partition(".")
    if m := _TIMM_VIT.match(arch):
        model = f"vit-{_TIMM_SIZES[m.group(1)]}/{m.group(2)}"
    elif (m := _TIMM_HYBRID.match(arch)) and m.group(1) in _TIMM_HYBRIDS:
        model = _TIMM_HYBRIDS[m.group(1)]
    else:
        return None
    size = int(m.group(m.lastindex))
    return PeerName(model, size, tag if dot and tag else None)


def timm_architecture_names() -> list[str]:
    """timm's names of the paper's ViTs and hybrids at 224 and 384 px (for suggestions: a typo in a timm name)."""
    vits = [f"vit_{size}_patch{patch}_{px}" for size in _TIMM_SIZES for patch in (8, 14, 16, 32) for px in (224, 384)]
    return vits + [f"{arch}_{px}" for arch in _TIMM_HYBRIDS for px in (224, 384)]


def image_size_of(name: str) -> int | None:
    """The resolution a timm architecture name states (`vit_base_patch16_384` -> 384), else None."""
    peer = timm_name(name)
    return peer.image_size if peer is not None else None


def checkpoint_candidates(peer: PeerName) -> list[str]:
    """vitlab checkpoint names a timm name (`timm_name`'s reading) can mean, most specific first: the tag with the
    name's resolution appended (vitlab's fine-tuned tags carry it), then the tag as it is (pre-training tags do not);
    none for an architecture name."""
    if peer.tag is None:
        return []
    tag = peer.tag.replace("_", "-")
    return [f"{peer.model}.{tag}-{peer.image_size}", f"{peer.model}.{tag}"]


def looks_like_hf_repo(name: str) -> bool:
    """`ORG/NAME` as the Hugging Face Hub spells a repo (a local path that exists is checked before this)."""
    return bool(_HF_REPO.match(name.strip()))
