"""The published checkpoints by name: `MODEL.TAG`, e.g. `vit-b/16.augreg-in21k-ft-in1k-224`.

MODEL is the vitlab registry name the weights fit; TAG says the recipe and data like timm's tags:
`orig-` (the 2020 ViT paper release), `augreg-` ("How to train your ViT?"), `bit-s-`/`bit-m-` (BiT),
`hf-` (the converted google/vit-* Hub copies); then the pre-training data (`in21k`, `in1k`) and, for a
fine-tuned file, `-ft-in1k-RES` with the fine-tuning resolution. `pretrained=True` takes a model's first
entry (the ImageNet-1k classifier where there is one). Torch-free: `vitlab models --pretrained` lists it.

Google's buckets publish no hashes or sizes, so those entries are "unverified": the download is checked
against the server's Content-Length, and the `.npz` zip members' CRC-32 when the file is read.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass

from vitlab.errors import VitlabError
from vitlab.weights import peer_names

VIT_BUCKET = "https://storage.googleapis.com/vit_models"
BIT_BUCKET = "https://storage.googleapis.com/bit_models"
HALF = (0.5, 0.5, 0.5)  # official ViT/BiT/HF inputs in [-1, 1]
_IN21K, _IN1K = "imagenet21k", "imagenet1k"


@dataclass(frozen=True)
class Pretrained:
    """One published checkpoint: where it lives, what model it fits, how to feed it, what it predicts."""

    name: str  # MODEL.TAG
    model: str  # vitlab registry name
    source: str  # 'vit-bucket', 'bit-bucket' or 'hf'
    path: str  # bucket-relative file, or the Hub repo id
    image_size: int
    labels: str  # 'imagenet21k' (21843 classes), 'imagenet1k' (1000) or 'none'
    licence: str = "Apache-2.0"
    mean: tuple[float, float, float] = HALF
    std: tuple[float, float, float] = HALF
    size: int | None = None  # bytes, where published
    sha256: str | None = None  # where published
    note: str = ""

    @property
    def tag(self) -> str:
        return self.name.partition(".")[2]

    @property
    def url(self) -> str:
        """The download address (the bucket base URLs follow $VITLAB_WEIGHTS_URL / $VITLAB_BIT_URL)."""
        if self.source == "hf":
            return f"https://huggingface.co/{self.path}"
        return f"{bucket_url(self.source)}/{self.path}"

    @property
    def spec(self) -> str:
        """What `vitlab.weights.hub.resolve` fetches: an `hf:` id or the bucket file."""
        return f"hf:{self.path}" if self.source == "hf" else self.url

    @property
    def integrity(self) -> str:
        if self.source == "hf":
            return "hub"  # huggingface_hub's own checks (ETag / LFS)
        return "sha256" if self.sha256 else ("size" if self.size else "unverified")


def bucket_url(source: str) -> str:
    """The base URL of a bucket; tests and mirrors override it with VITLAB_WEIGHTS_URL / VITLAB_BIT_URL."""
    if source == "bit-bucket":
        return os.environ.get("VITLAB_BIT_URL", BIT_BUCKET).rstrip("/")
    return os.environ.get("VITLAB_WEIGHTS_URL", VIT_BUCKET).rstrip("/")


def _orig(size: str, patch: int) -> list[Pretrained]:
    """The 2020 release: i21k pre-training, and i21k -> ImageNet at 384 (and at 224 where published)."""
    model, stem = f"vit-{size.lower()}/{patch}", f"ViT-{size}_{patch}"
    out = []
    if (size, patch) in {("B", 16), ("B", 32), ("B", 8), ("L", 16), ("L", 32)}:
        out.append(Pretrained(f"{model}.orig-in21k-ft-in1k-384", model, "vit-bucket",
                              f"imagenet21k+imagenet2012/{stem}.npz", 384, _IN1K))
    if (size, patch) in {("B", 16), ("L", 16)}:
        out.append(Pretrained(f"{model}.orig-in21k-ft-in1k-224", model, "vit-bucket",
                              f"imagenet21k+imagenet2012/{stem}-224.npz", 224, _IN1K))
    out.append(Pretrained(f"{model}.orig-in21k", model, "vit-bucket", f"imagenet21k/{stem}.npz", 224, _IN21K,
                          note="head zeroed by the authors: fine-tune before predicting"))
    return out


# AugReg recipes of the recommended checkpoints (timm's augreg cfgs; google-research/vision_transformer README)
_AUGREG_I21K = {
    "ti/16": "Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0",
    "s/32": "S_32-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0",
    "s/16": "S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0",
    "b/32": "B_32-i21k-300ep-lr_0.001-aug_medium1-wd_0.03-do_0.0-sd_0.0",
    "b/16": "B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0",
    "b/8": "B_8-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0",
    "l/16": "L_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1",
}
# (pre-training file, fine-tune lr) of the i21k -> ImageNet files per resolution (B/32 at 384 uses another run)
_AUGREG_FT = {
    ("ti/16", 224): ("ti/16", "0.03"), ("ti/16", 384): ("ti/16", "0.03"),
    ("s/32", 224): ("s/32", "0.03"), ("s/32", 384): ("s/32", "0.03"),
    ("s/16", 224): ("s/16", "0.03"), ("s/16", 384): ("s/16", "0.03"),
    ("b/32", 224): ("b/32", "0.03"),
    ("b/32", 384): ("B_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0", "0.03"),
    ("b/16", 224): ("b/16", "0.01"), ("b/16", 384): ("b/16", "0.01"), ("b/8", 224): ("b/8", "0.01"),
    ("l/16", 224): ("l/16", "0.01"), ("l/16", 384): ("l/16", "0.01"),
}
_AUGREG_I1K = {
    "s/16": "S_16-i1k-300ep-lr_0.001-aug_medium2-wd_0.1-do_0.0-sd_0.0",
    "b/32": "B_32-i1k-300ep-lr_0.001-aug_medium2-wd_0.1-do_0.1-sd_0.1",
    "b/16": "B_16-i1k-300ep-lr_0.001-aug_strong2-wd_0.1-do_0.1-sd_0.1",
}


def _augreg(arch: str) -> list[Pretrained]:
    model = f"vit-{arch}"
    out = []
    for res in (224, 384):
        if (key := (arch, res)) in _AUGREG_FT:
            up, lr = _AUGREG_FT[key]
            stem = _AUGREG_I21K.get(up, up)
            out.append(Pretrained(f"{model}.augreg-in21k-ft-in1k-{res}", model, "vit-bucket",
                                  f"augreg/{stem}--imagenet2012-steps_20k-lr_{lr}-res_{res}.npz", res, _IN1K))
    out.append(Pretrained(f"{model}.augreg-in21k", model, "vit-bucket", f"augreg/{_AUGREG_I21K[arch]}.npz", 224,
                          _IN21K))
    if arch in _AUGREG_I1K:
        for res in (224, 384):
            out.append(Pretrained(f"{model}.augreg-in1k-{res}", model, "vit-bucket",
                                  f"augreg/{_AUGREG_I1K[arch]}--imagenet2012-steps_20k-lr_0.01-res_{res}.npz",
                                  res, _IN1K))
    return out


def _bit(depth: int, width: int) -> list[Pretrained]:
    model, stem = f"bit-r{depth}x{width}", f"R{depth}x{width}"
    return [
        # the size the file loads at (big_transfer.py: BiT-HyperRule's 480 for ImageNet), so that the listing and
        # the loaded model agree; timm's cfgs evaluate these files at 448 (480 for R152x4)
        Pretrained(f"{model}.bit-m-in21k-ft-in1k", model, "bit-bucket", f"BiT-M-{stem}-ILSVRC2012.npz", 480, _IN1K,
                   note="BiT-M fine-tuned on ImageNet-1k at 480 px (BiT-HyperRule); timm evaluates at 448"),
        Pretrained(f"{model}.bit-m-in21k", model, "bit-bucket", f"BiT-M-{stem}.npz", 224, _IN21K),
        Pretrained(f"{model}.bit-s-in1k", model, "bit-bucket", f"BiT-S-{stem}.npz", 224, _IN1K),
    ]


# google/vit-* on the Hugging Face Hub (converted from the official i21k / i21k -> ImageNet files)
_HF = [
    ("vit-b/16", "google/vit-base-patch16-224", "hf-in21k-ft-in1k-224", 224, _IN1K),
    ("vit-b/16", "google/vit-base-patch16-384", "hf-in21k-ft-in1k-384", 384, _IN1K),
    ("vit-b/16", "google/vit-base-patch16-224-in21k", "hf-in21k", 224, "none"),
    ("vit-b/32", "google/vit-base-patch32-384", "hf-in21k-ft-in1k-384", 384, _IN1K),
    ("vit-b/32", "google/vit-base-patch32-224-in21k", "hf-in21k", 224, "none"),
    ("vit-l/16", "google/vit-large-patch16-224", "hf-in21k-ft-in1k-224", 224, _IN1K),
    ("vit-l/16", "google/vit-large-patch16-384", "hf-in21k-ft-in1k-384", 384, _IN1K),
    ("vit-l/16", "google/vit-large-patch16-224-in21k", "hf-in21k", 224, "none"),
    ("vit-l/32", "google/vit-large-patch32-384", "hf-in21k-ft-in1k-384", 384, _IN1K),
    ("vit-l/32", "google/vit-large-patch32-224-in21k", "hf-in21k", 224, "none"),
    ("vit-h/14", "google/vit-huge-patch14-224-in21k", "hf-in21k", 224, "none"),
]


def _build() -> dict[str, Pretrained]:
    entries: list[Pretrained] = []
    for arch in ("ti/16", "s/32", "s/16", "b/32", "b/16", "b/8", "l/16"):
        entries += _augreg(arch)
    for size, patch in (("B", 16), ("B", 32), ("B", 8), ("L", 16), ("L", 32), ("H", 14)):
        entries += _orig(size, patch)
    entries += [
        Pretrained("r50+vit-b/16.orig-in21k-ft-in1k-384", "r50+vit-b/16", "vit-bucket",
                   "imagenet21k+imagenet2012/R50+ViT-B_16.npz", 384, _IN1K),
        Pretrained("r50+vit-b/16.orig-in21k", "r50+vit-b/16", "vit-bucket", "imagenet21k/R50+ViT-B_16.npz", 224,
                   _IN21K, note="head zeroed by the authors: fine-tune before predicting"),
        Pretrained("r26+vit-b/32.orig-in21k", "r26+vit-b/32", "vit-bucket", "imagenet21k/R26+ViT-B_32.npz", 224,
                   _IN21K),
        Pretrained("r50+vit-l/32.orig-in21k", "r50+vit-l/32", "vit-bucket", "imagenet21k/R50+ViT-L_32.npz", 224,
                   _IN21K),
    ]
    for depth, width in ((50, 1), (50, 3), (101, 1), (101, 3), (152, 2), (152, 4)):
        entries += _bit(depth, width)
    entries += [Pretrained(f"{m}.{tag}", m, "hf", repo, res, labels) for m, repo, tag, res, labels in _HF]
    return {e.name: e for e in entries}


PRETRAINED: dict[str, Pretrained] = _build()
_BY_HF_REPO = {e.path.lower(): e for e in PRETRAINED.values() if e.source == "hf"}


def names(model: str | None = None) -> list[str]:
    """Every checkpoint name (of one registry model when `model` is given), in table order."""
    return [n for n, e in PRETRAINED.items() if model is None or e.model == model]


def _normalize(name: str) -> str:
    model, dot, tag = name.strip().partition(".")
    model = model.lower().replace("_", "/") if model.lower().startswith("vit_") else model.lower()
    return f"{model}{dot}{tag.lower().replace('_', '-')}"


def lookup(name: str) -> Pretrained | None:
    """The entry for `MODEL.TAG` (case and `_`/`-` forgiving), timm's name of the same checkpoint
    (`vit_base_patch16_224.augreg_in21k_ft_in1k`) or its Hugging Face repo id (`google/vit-base-patch16-224`); None
    when `name` is not a checkpoint name."""
    if entry := PRETRAINED.get(name) or PRETRAINED.get(_normalize(name)):
        return entry
    if (peer := peer_names.timm_name(name)) is not None:
        for candidate in peer_names.checkpoint_candidates(peer):
            entry = PRETRAINED.get(candidate)
            if entry is not None and entry.image_size == peer.image_size:
                return entry
    if peer_names.looks_like_hf_repo(name):
        return _BY_HF_REPO.get(name.strip().lower())
    return None


def get(name: str) -> Pretrained:
    """The entry for `MODEL.TAG`; an unknown name fails in one line with the closest names."""
    if (entry := lookup(name)) is not None:
        return entry
    close = difflib.get_close_matches(_normalize(name), list(PRETRAINED), n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    raise VitlabError(f"unknown pretrained checkpoint {name!r}{hint}; `vitlab models --pretrained` lists them")


def for_model(model: str, pretrained: bool | str, image_size: int | None = None) -> Pretrained:
    """The entry `create_model(model, pretrained=...)` means: True = the model's default (the first at
    `image_size`, where a timm name states one), a tag, or a full name."""
    if pretrained is True:
        if not (found := names(model)):
            raise VitlabError(f"no published checkpoint for {model!r}; `vitlab models --pretrained` lists the models "
                              "that have one (or pass pretrained=PATH to a weights file)")
        if image_size is not None:
            at_size = [n for n in found if PRETRAINED[n].image_size == image_size]
            if not at_size:
                sizes = sorted({PRETRAINED[n].image_size for n in found})
                raise VitlabError(f"no published checkpoint of {model!r} at {image_size} px (its resolutions: "
                                  f"{', '.join(map(str, sizes))}); `vitlab models --pretrained` lists them")
            found = at_size
        return PRETRAINED[found[0]]
    text = str(pretrained)
    entry = lookup(text) or lookup(f"{model}.{text}")
    if entry is None:
        tags = ", ".join(PRETRAINED[n].tag for n in names(model)) or "none"
        raise VitlabError(f"{text!r} is not a checkpoint of {model!r} (its tags: {tags}); "
                          "`vitlab models --pretrained` lists them")
    if entry.model != model:
        raise VitlabError(f"{entry.name} is a checkpoint of {entry.model!r}, not {model!r}; "
                          f"use create_model({entry.model!r}, pretrained={entry.tag!r})")
    return entry
