"""Audit: the evaluation resize + centre crop reproduce torchvision / timm / Hugging Face arithmetic exactly.

vitlab stores torchvision's (`Resize(256) + CenterCrop(224)`), timm's (`Resize(floor(224 / crop_pct)) +
CenterCrop(224)`) and Hugging Face ConvNext's (`shortest_edge / crop_pct`, crop) evaluation transforms with their
weights (docs/weights.md). Those libraries size the shorter-side resize and place the crop with:

- torchvision `_compute_resized_output_size`: long side = `int(size * long / short)` (truncated, not rounded);
- torchvision `center_crop`: top = `int(round((H - h) / 2.0))` (Python's round: half to even);
- timm `transforms_imagenet_eval`: `scale_size = math.floor(img_size / crop_pct)`.

Before the fix vitlab rounded the long side, floored the crop offset and rounded img_size / crop_pct (249 for
timm's 224 / 0.9 where timm uses 248): a one-pixel shift or a 0.4 % scale change, measured against the peers
(/work/peers: torchvision 0.29.1, timm 1.0.31, transformers 5.24.0) as a max difference after normalisation
of 1.2-3.0 on real photos (a 401x299 grey photo: 3.0 against torchvision's ResNet50 V1 transforms; 333x500:
1.3 against timm's vit_base_patch16_224), and 0.09-0.14 on strongly blurred photos. After the fix the same
comparison gives <= 0.0175 (one level of 255 at ImageNet's std; PIL rounds to uint8) for torchvision, and for
timm <= 0.025 on real and <= 0.009 on blurred photos (PIL's bicubic rounds its intermediate pass to uint8).

The references below are those formulas written out, with PIL's resize (which torchvision's and timm's PIL
path call) doing the resampling, so the test runs without torchvision or timm.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from vitlab.data.preprocess import Preprocess, resize_crop_batch

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def tv_resized_size(h: int, w: int, size: int) -> tuple[int, int]:
    """torchvision.transforms.functional._compute_resized_output_size for an int size (h, w out)."""
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    return new_h, new_w


def tv_crop_offsets(h: int, w: int, th: int, tw: int) -> tuple[int, int]:
    """torchvision.transforms.functional.center_crop's (top, left)."""
    return int(round((h - th) / 2.0)), int(round((w - tw) / 2.0))


def smooth_noise(h: int, w: int, channels: int = 3, seed: int = 0) -> torch.Tensor:
    """Sharp enough that a one-pixel shift shows (noise), uint8 (C, H, W)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (channels, h, w), generator=g, dtype=torch.uint8)


# (h, w) pairs where the old arithmetic (round / floor) and torchvision's (int / round-half-even) disagree
# on the long side, on the crop offset, or on both; and some where they agree.
SIZES = [(383, 257), (451, 300), (299, 401), (227, 225), (500, 333), (333, 500), (1000, 17), (17, 1000), (224, 224),
         (90, 120)]


@pytest.mark.parametrize("h,w", SIZES)
@pytest.mark.parametrize("resize,crop", [(256, 224), (384, 384), (248, 224)])
def test_resize_crop_geometry_is_torchvision_s(h, w, resize, crop):
    """resize_crop_batch == F.interpolate to torchvision's size, then torchvision's crop window, exactly."""
    x = smooth_noise(h, w).float()[None]
    nh, nw = tv_resized_size(h, w, resize)
    top, left = tv_crop_offsets(nh, nw, crop, crop)
    ref = F.interpolate(x, size=(nh, nw), mode="bilinear", align_corners=False, antialias=True)
    ref = ref[..., top:top + crop, left:left + crop]
    got = resize_crop_batch(x, (crop, crop), resize, "bilinear")
    assert got.shape == ref.shape
    assert torch.equal(got, ref)


def test_crop_fraction_resize_is_timm_floor():
    """timm: scale_size = math.floor(img_size / crop_pct): 224 / 0.9 -> 248 (not 249), 224 / 0.875 -> 256."""
    for size, crop_pct in [(224, 0.9), (224, 0.875), (224, 0.95), (256, 0.95), (384, 0.96), (288, 1.0 - 1e-9)]:
        pre = Preprocess.for_model(size, crop_fraction=crop_pct, interpolation="bicubic")
        assert pre.effective_resize == math.floor(size / crop_pct), (size, crop_pct)


@pytest.mark.parametrize("h,w", [(383, 257), (299, 401), (227, 225), (333, 500)])
def test_torchvision_v1_record_matches_pil_reference(h, w):
    """The torchvision V1 record (shorter side 256, crop 224, bilinear, ImageNet statistics) against
    torchvision's PIL pipeline written out: PIL bilinear resize, crop, ToTensor, Normalize. PIL rounds its
    result to uint8, so one level of 255 (0.0175 at std 0.224) separates them; a shifted crop gives ~1-3."""
    img = smooth_noise(h, w, seed=1)
    pil = Image.fromarray(img.permute(1, 2, 0).numpy())
    nh, nw = tv_resized_size(h, w, 256)
    top, left = tv_crop_offsets(nh, nw, 224, 224)
    ref = np.asarray(pil.resize((nw, nh), Image.BILINEAR).crop((left, top, left + 224, top + 224)), np.float32)
    ref = (torch.from_numpy(ref).permute(2, 0, 1) / 255.0 - torch.tensor(IMAGENET_MEAN).view(3, 1, 1)) \
        / torch.tensor(IMAGENET_STD).view(3, 1, 1)
    pre = Preprocess(image_size=(224, 224), mean=IMAGENET_MEAN, std=IMAGENET_STD, resize=256)
    got = pre(pil)
    assert (got - ref).abs().max().item() < 0.0355  # two levels of 255 at the smallest std


def test_timm_vit_224_record_matches_pil_reference():
    """timm's vit_base_patch16_224 eval transform (bicubic, crop_pct 0.9, mean = std = 0.5) written out with PIL,
    on a smooth image (PIL's bicubic rounds its horizontal pass to uint8: a level or two on sharp edges)."""
    yy, xx = np.mgrid[0:333, 0:500].astype(np.float32)
    arr = np.stack([127 + 120 * np.sin(xx / 23.0), 127 + 120 * np.cos(yy / 17.0), (xx + yy) * 255.0 / 831.0], -1)
    pil = Image.fromarray(arr.round().clip(0, 255).astype(np.uint8))
    scale = math.floor(224 / 0.9)  # 248
    nh, nw = tv_resized_size(333, 500, scale)
    top, left = tv_crop_offsets(nh, nw, 224, 224)
    ref = np.asarray(pil.resize((nw, nh), Image.BICUBIC).crop((left, top, left + 224, top + 224)), np.float32)
    ref = torch.from_numpy(ref).permute(2, 0, 1) / 127.5 - 1.0
    got = Preprocess.for_model(224, crop_fraction=0.9, interpolation="bicubic")(pil)
    assert (got - ref).abs().max().item() < 0.02


@pytest.mark.parametrize("h,w,size", [(40, 7, (96, 17)), (50, 75, (224, 336)), (333, 500, (248, 372)), (90, 120, (33, 44)),
                                      (12, 12, (30, 30))])
def test_bicubic_resize_matches_pil_on_sharp_images(h, w, size):
    """PIL resizes in two passes, horizontal first, keeping the intermediate image in 8 bits, so bicubic's
    overshoot is clipped between the passes; timm's eval (bicubic for its ViTs) and torchvision's PIL path call
    it. One 2-D float call differed from PIL by up to 25 levels of 255 on sharp photos (0.2 after [-1, 1]
    normalisation); with the intermediate rounded as PIL does, PIL's fixed-point weights leave under 2 levels."""
    img = smooth_noise(h, w, seed=3)
    pil = Image.fromarray(img.permute(1, 2, 0).numpy()).resize((size[1], size[0]), Image.BICUBIC)
    ref = torch.from_numpy(np.asarray(pil, np.float32)).permute(2, 0, 1)
    from vitlab.data.preprocess import resize_batch

    got = resize_batch(img.float()[None], size, "bicubic")[0]
    assert (got - ref).abs().max().item() < 2.0


@pytest.mark.parametrize("w, h", [(333, 500), (500, 333), (257, 383), (401, 299), (17, 1000)])
def test_storage_crop_is_the_evaluation_crop(w, h):
    """The stored square (`images.resize_shorter_center_crop`) rounded the long side and floored the offset while
    the evaluation's resize + crop (torchvision's arithmetic) truncates and rounds: the same file came out one pixel
    apart in `vitlab evaluate` (stored images) and `vitlab predict` (the file itself)."""
    from PIL import Image

    from vitlab.data.images import resize_shorter_center_crop

    rng = np.random.default_rng(w * h)
    img = Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8))
    size = min(w, h) - 1 if min(w, h) > 20 else min(w, h)
    stored = np.asarray(resize_shorter_center_crop(img, size))
    nw, nh = (size, int(size * h / w)) if w <= h else (int(size * w / h), size)
    left, top = int(round((nw - size) / 2.0)), int(round((nh - size) / 2.0))
    expected = np.asarray(img.resize((nw, nh), Image.BILINEAR, reducing_gap=3.0))[top:top + size, left:left + size]
    assert np.array_equal(stored, expected)
