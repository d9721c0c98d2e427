"""Evaluation / prediction preprocessing as one serialisable record (stored next to saved weights).

`Preprocess` turns one PIL image into the normalised float tensor a model expects. The same
torch code (`resize_crop_batch`, `normalize_batch`) runs the batched evaluation transform, so a
prediction on a file and an evaluation on the same image give the same input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F

from vitlab.data.pillow_resize import PILLOW_FILTERS, pillow_resize
from vitlab.errors import VitlabError
from vitlab.limits import MAX_IMAGE_SIZE  # the model configs' limit: a larger side is a corrupted record

# bilinear and bicubic run as torch's anti-aliased interpolate (PIL's filters, within a grey level); nearest, box,
# hamming and lanczos as Pillow itself resizes (`pillow_resize`: torch has no counterpart); area is torch's own
# (adaptive average pooling), kept for records that name it
INTERPOLATIONS = ("bilinear", "bicubic", "nearest", "area", "box", "hamming", "lanczos")
# What happens before the centre crop (timm's `crop_mode` names): "center" resizes the shorter side to `resize`
# and keeps the aspect ratio (torchvision's Resize(int), timm's default); "squash" resizes the whole image to
# resize x resize (Hugging Face's DeiT and BEiT processors, `size` {"height": 256, "width": 256} before a 224 crop,
# and timm's crop_mode "squash").
CROP_MODES = ("center", "squash")
# Where a centre crop starts when its margin H - h is odd: "round" at round((H - h) / 2), half to even
# (torchvision's center_crop, which timm's evaluation and vitlab's own training use); "floor" at (H - h) // 2
# (Hugging Face transformers' processors, both backends). The two are a pixel apart at margins 3, 7, 11, ...
CROP_OFFSETS = ("round", "floor")


def _pair(v: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    h, w = (int(x) for x in v)
    return (h, w)


def _per_channel(v: float | Sequence[float], channels: int) -> tuple[float, ...]:
    vals = (float(v),) if isinstance(v, (int, float)) else tuple(float(x) for x in v)
    if len(vals) == channels:
        return vals
    if len(vals) == 1:
        return vals * channels
    if channels == 1 and len(vals) == 3:
        return (sum(vals) / 3.0,)  # RGB statistics used on grey input: their mean
    raise VitlabError(f"the preprocessing's mean/std has {len(vals)} values for {channels} channels; "
                      f"give 1 or {channels} values")


def _check_statistics(mean: tuple[float, ...], std: tuple[float, ...]) -> None:
    """The point of use of the normalisation: a std of 0 divides by zero and NaN spreads into every logit."""
    if not all(math.isfinite(m) for m in mean):
        raise VitlabError(f"the preprocessing's mean {list(mean)} is not finite; the stored preprocessing is broken "
                          "(re-save the weights, or fix 'mean' in their config.json)")
    if not all(math.isfinite(s) and s > 0 for s in std):
        raise VitlabError(f"the preprocessing's std {list(std)} must be finite and > 0; the stored preprocessing is "
                          "broken (re-save the weights, or fix 'std' in their config.json)")


def _check_sizes(image_size: tuple[int, int], resize: int | None) -> None:
    sides = list(image_size) + ([resize] if resize is not None else [])
    if not all(1 <= side <= MAX_IMAGE_SIZE for side in sides):
        raise VitlabError(f"the preprocessing's image_size {list(image_size)} / resize {resize} is outside "
                          f"1-{MAX_IMAGE_SIZE} px; the stored preprocessing is broken (fix 'image_size' in config.json)")


def resize_batch(x: torch.Tensor, size: tuple[int, int], interpolation: str = "bilinear",
                 antialias: bool = True) -> torch.Tensor:
    """Resize a float batch (B, C, H, W) of 0..255 values to `size` (h, w), anti-aliased when shrinking unless
    `antialias=False`: then bilinear is TensorFlow's `tf.image.resize` (half-pixel centres, no anti-aliasing),
    what the official ViT and BiT evaluation pipelines call. Pillow's filters without a torch counterpart
    (`PILLOW_FILTERS`) are Pillow's own resize, which always anti-aliases."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
    if interpolation in PILLOW_FILTERS:
        return pillow_resize(x, size, interpolation)
    kwargs = {}
    if interpolation in ("bilinear", "bicubic"):
        kwargs = {"align_corners": False, "antialias": bool(antialias)}
    if interpolation == "bicubic":
        # bicubic overshoots at edges. PIL (what timm's and torchvision's PIL eval transforms call) resizes in two
        # passes, horizontal first, keeping the intermediate in 8 bits, so the overshoot is clipped in between; one
        # 2-D float call differed from it by up to 25 levels of 255 on sharp photos, this by under 2. Clipped here
        # so training's plain resize, the evaluation and the loader's resize all give the same values.
        h, w = x.shape[-2:]
        if w != size[1]:
            x = F.interpolate(x, size=(h, size[1]), mode="bicubic", **kwargs).round().clamp(0, 255)
        if h != size[0]:
            x = F.interpolate(x, size=size, mode="bicubic", **kwargs).clamp(0, 255)
        return x
    return F.interpolate(x, size=size, mode=interpolation, **kwargs)


def crop_start(margin: int, crop_offset: str = "round") -> int:
    """The first row (column) of a centred window in a side `margin` pixels longer than it (`CROP_OFFSETS`)."""
    if crop_offset not in CROP_OFFSETS:
        raise ValueError(f"crop_offset must be one of {CROP_OFFSETS}, got {crop_offset!r}")
    if margin <= 0:
        return 0
    # Python's round is half to even, as torchvision's int(round(d / 2.0)): 3 / 2 -> 2, 5 / 2 -> 2
    return margin // 2 if crop_offset == "floor" else int(round(margin / 2.0))


def square_start(margin: int, inner_margin: int | None, crop_offset: str = "round") -> int:
    """Where a stored square starts on a side `margin` pixels longer than it, when the model later cuts its own
    centre crop, `inner_margin` pixels shorter than the square, from it (None: no later crop, the square's own
    centre). The square starts so that the later crop lands where one crop of the whole resized photo lands
    (`vitlab predict`): crop_start(margin + inner) - crop_start(inner). Two centred cuts in a row drift a pixel from
    one unless the inner margin is a multiple of 4 (round) or even (floor): e.g. 57 -> 50 -> 40 px, round."""
    if inner_margin is None or inner_margin < 0:
        return crop_start(margin, crop_offset)
    return crop_start(margin + inner_margin, crop_offset) - crop_start(inner_margin, crop_offset)


def shorter_side_size(h: int, w: int, resize: int) -> tuple[int, int]:
    """(h, w) with the shorter side at `resize`: torchvision's Resize(int) sizes (timm's eval and HF's shortest_edge
    resize compute the same): the long side is truncated, int(resize * long / short); rounding made e.g. 382 px of
    381 (a 383x257 image to 256)."""
    long = int(resize * max(h, w) / min(h, w))
    return (long, resize) if w <= h else (resize, long)


def center_crop_batch(x: torch.Tensor, size: tuple[int, int], crop_offset: str = "round") -> torch.Tensor:
    """Cut the central `size` (h, w) window of a batch (B, C, H, W), placed as `crop_offset` says."""
    h, w = x.shape[-2:]
    th, tw = size
    # the model's own library decides the window: flooring where torchvision rounds (or the reverse) moved it
    # one pixel when h - th is 3, 7, 11, ...
    top, left = crop_start(h - th, crop_offset), crop_start(w - tw, crop_offset)
    return x[..., top : top + th, left : left + tw]


def resize_crop_batch(
    x: torch.Tensor, image_size: tuple[int, int], resize: int | None, interpolation: str = "bilinear",
    antialias: bool = True, squash: bool = False, crop_offset: str = "round",
) -> torch.Tensor:
    """`resize=None`: plain resize to `image_size` (official eval). Else shorter side -> `resize` (with `squash`:
    the whole image -> `resize` x `resize`, `CROP_MODES`), then the centre crop placed by `crop_offset`."""
    if resize is None:
        return resize_batch(x, image_size, interpolation, antialias)
    h, w = x.shape[-2:]
    if squash:
        nh = nw = resize
    else:
        nh, nw = shorter_side_size(h, w, resize)
    nh, nw = max(image_size[0], nh), max(image_size[1], nw)
    return center_crop_batch(resize_batch(x, (nh, nw), interpolation, antialias), image_size, crop_offset)


def match_channels(x: torch.Tensor, channels: int) -> torch.Tensor:
    """Grey -> 3 channels by repetition, RGB -> 1 channel by ITU-R 601 luma; works on uint8 or float."""
    c = x.shape[-3]
    if c == channels:
        return x
    if c == 1 and channels == 3:
        return x.expand(*x.shape[:-3], 3, *x.shape[-2:]).contiguous()
    if c == 3 and channels == 1:
        if x.dtype == torch.uint8:
            # Pillow's fixed-point luma, so a batch converted here (evaluate, training) equals the image that
            # predict / serve convert with Image.convert("L"); the float formula + round differed by one level
            # on 8,638 of the 2^24 colours.
            r, g, b = x.to(torch.int32).unbind(dim=-3)
            grey = (r * 19595 + g * 38470 + b * 7471 + 32768) >> 16
            return grey.unsqueeze(-3).to(torch.uint8)
        weights = torch.tensor([0.299, 0.587, 0.114], dtype=torch.float32, device=x.device).view(3, 1, 1)
        grey = (x.float() * weights).sum(dim=-3, keepdim=True)
        return grey.round().clamp(0, 255).to(x.dtype) if not x.is_floating_point() else grey.to(x.dtype)
    raise ValueError(f"cannot convert {c} channels to {channels}")


def normalize_batch(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Float values in [0, 255] -> (x / 255 - mean) / std per channel."""
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    return (x / 255.0 - m) / s


@dataclass(frozen=True)
class Preprocess:
    """How an image becomes model input at evaluation / prediction time.

    image_size: (h, w) of the model input. resize: shorter side before a centre crop of image_size;
    None = plain resize to image_size (the official ViT evaluation) unless crop_fraction < 1, which
    then sets resize = floor(max(image_size) / crop_fraction) (timm's rule). mean/std are on the [0, 1] scale:
    the default 0.5/0.5 gives values in [-1, 1] like the paper. antialias: shrink with anti-aliasing (PIL's
    resize, what timm's and Hugging Face's processors call); False is TensorFlow's `tf.image.resize`, the
    official ViT and BiT evaluation, which the official checkpoints' records ask for. crop_mode: how the image
    reaches `resize` before the crop, `CROP_MODES` ("center" keeps the aspect ratio, "squash" does not).
    crop_offset: where the centre crop starts at an odd margin, `CROP_OFFSETS` ("round" as torchvision and timm,
    "floor" as Hugging Face's processors; a pixel apart at margins 3, 7, 11, ...).
    """

    image_size: tuple[int, int] = (224, 224)
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    resize: int | None = None
    crop_fraction: float = 1.0
    interpolation: str = "bilinear"
    channels: int = 3
    antialias: bool = True
    crop_mode: str = "center"
    crop_offset: str = "round"

    def __post_init__(self) -> None:
        # Stored records are read from files a user may have edited: every refusal is one VitlabError line.
        try:
            object.__setattr__(self, "image_size", _pair(self.image_size))
            if self.resize is not None:
                object.__setattr__(self, "resize", int(self.resize))
        except (TypeError, ValueError):
            raise VitlabError(f"the preprocessing's image_size {self.image_size!r} / resize {self.resize!r} are not "
                              "whole numbers; fix them in the weights' config.json") from None
        if self.channels not in (1, 3):
            raise VitlabError(f"the preprocessing's channels must be 1 or 3, got {self.channels}")
        try:
            object.__setattr__(self, "mean", _per_channel(self.mean, self.channels))
            object.__setattr__(self, "std", _per_channel(self.std, self.channels))
        except (TypeError, ValueError):
            raise VitlabError(f"the preprocessing's mean {self.mean!r} / std {self.std!r} are not numbers; "
                              "fix them in the weights' config.json") from None
        _check_statistics(self.mean, self.std)
        _check_sizes(self.image_size, self.resize)
        if not (isinstance(self.crop_fraction, (int, float)) and 0.0 < self.crop_fraction <= 1.0):
            raise VitlabError(f"the preprocessing's crop_fraction must be in (0, 1], got {self.crop_fraction!r}")
        if self.interpolation not in INTERPOLATIONS:
            raise VitlabError(f"the preprocessing's interpolation must be one of {', '.join(INTERPOLATIONS)}, "
                              f"got {self.interpolation!r}")
        if not isinstance(self.antialias, bool):  # a JSON "false" string would be truthy
            raise VitlabError(f"the preprocessing's antialias must be true or false, got {self.antialias!r}; "
                              "fix it in the weights' config.json")
        if self.crop_mode not in CROP_MODES:
            raise VitlabError(f"the preprocessing's crop_mode must be one of {', '.join(CROP_MODES)}, got "
                              f"{self.crop_mode!r}; fix it in the weights' config.json")
        if self.crop_offset not in CROP_OFFSETS:
            raise VitlabError(f"the preprocessing's crop_offset must be one of {', '.join(CROP_OFFSETS)}, got "
                              f"{self.crop_offset!r}; fix it in the weights' config.json")

    @property
    def effective_resize(self) -> int | None:
        """The shorter-side size used before the centre crop, or None for a plain resize."""
        if self.resize is not None:
            return int(self.resize)
        if self.crop_fraction < 1.0:  # timm's scale_size = math.floor(img_size / crop_pct): 224 / 0.9 -> 248
            return math.floor(max(self.image_size) / self.crop_fraction)
        return None

    @property
    def model_side(self) -> int:
        """The side a stored (square) image needs so that this preprocessing only shrinks or keeps it: the
        shorter side before the crop, else the input's longer side (`load_data(model_side=...)`)."""
        return int(self.effective_resize or max(self.image_size))

    @property
    def squashes(self) -> bool:
        """Whether a non-square image is resized whole, its aspect ratio lost: a plain resize to the input (the
        official evaluation, HF's ViTImageProcessor) or crop_mode "squash" before the crop (HF's DeiT processor).
        File data for such a model is stored squashed too (`load_data(squash=True)`)."""
        return self.effective_resize is None or self.crop_mode == "squash"

    def crop_moves_under(self, placement: str) -> bool:
        """Whether a library that starts every centre crop at `placement` (`CROP_OFFSETS`) would cut this record's
        crop from other pixels for some photo: what an export to that library must say."""
        return self.crop_offset != placement and self.crop_offset_matters

    @property
    def crop_offset_matters(self) -> bool:
        """Whether "round" and "floor" (`CROP_OFFSETS`) start this record's centre crop on other pixels for some
        photo: round(m / 2) is half to even, so they differ exactly at margins m = 3, 7, 11, ... After a shorter-side
        resize the longer side's margin depends on the photo, so any may; after a squash both margins are fixed."""
        resize = self.effective_resize
        if resize is None:
            return False
        if self.crop_mode != "squash":
            return True
        return any((resize - side) % 4 == 3 for side in self.image_size)

    def storage(self) -> dict:
        """`load_data`'s storage arguments for file images this preprocessing will read: stored at least at
        `model_side` (and, for larger photos, exactly at it), squashed where it `squashes`, and shrunk as it shrinks
        (`antialias`) with its filter (`interpolation`) and its crop placement (`crop_offset`, `model_crop`), so that a stored
        image is the one this preprocessing would make of the file, but for 8-bit rounding
        (`load_data(..., **preprocess.storage())`)."""
        crop = None if self.squashes else tuple(self.image_size)  # cut later from a square stored at model_side
        return {"model_side": self.model_side, "squash": self.squashes, "antialias": self.antialias,
                "shrink_to_model": True, "interpolation": self.interpolation, "crop_offset": self.crop_offset,
                "model_crop": crop}

    def batch(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (B, C, H, W) on any device -> normalised float (B, channels, h, w)."""
        x = match_channels(images, self.channels).float()
        x = resize_crop_batch(x, self.image_size, self.effective_resize, self.interpolation,  # bicubic: clipped
                              self.antialias, squash=self.crop_mode == "squash", crop_offset=self.crop_offset)
        return normalize_batch(x, self.mean, self.std)

    def __call__(self, image) -> torch.Tensor:
        """One PIL image (any mode) or uint8 tensor (C, H, W) -> float tensor (channels, h, w)."""
        if not isinstance(image, torch.Tensor):
            from vitlab.data.images import normalise_mode, pil_to_tensor

            image = pil_to_tensor(normalise_mode(image, "L" if self.channels == 1 else "RGB"))
        return self.batch(image.unsqueeze(0))[0]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["image_size"] = list(self.image_size)
        d["mean"], d["std"] = list(self.mean), list(self.std)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Preprocess:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        if "image_size" in kwargs:
            kwargs["image_size"] = _pair(kwargs["image_size"])
        for key in ("mean", "std"):
            if key in kwargs and not isinstance(kwargs[key], (int, float)):
                kwargs[key] = tuple(kwargs[key])
        return cls(**kwargs)

    @classmethod
    def for_model(cls, image_size: int | Sequence[int], channels: int = 3, crop_fraction: float = 1.0,
                  mean: float | Sequence[float] = 0.5, std: float | Sequence[float] = 0.5,
                  interpolation: str = "bilinear") -> Preprocess:
        """Convenience constructor: [-1, 1] values, plain resize unless crop_fraction < 1."""
        return cls(image_size=_pair(image_size), mean=_per_channel(mean, channels), std=_per_channel(std, channels),
                   crop_fraction=crop_fraction, interpolation=interpolation, channels=channels)
