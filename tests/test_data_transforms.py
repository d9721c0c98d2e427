"""Transforms: shapes, value ranges, determinism, and agreement with plain torch references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from vitlab.data import Preprocess
from vitlab.data.transforms import (
    TransformConfig,
    build_eval_transform,
    build_train_transform,
    crop_resize,
    mix_batch,
    random_shift,
    sample_crop_boxes,
)


def _batch(n=16, c=1, size=28, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, c, size, size), dtype=torch.uint8, generator=g)


def test_train_shape_range_and_determinism():
    x = _batch()
    tf = build_train_transform(TransformConfig(image_size=32, channels=1))
    y1, y2, y3 = tf(x, seed=7), tf(x, seed=7), tf(x, seed=8)
    assert y1.shape == (16, 1, 32, 32) and y1.dtype == torch.float32
    assert y1.min() >= -1.0 and y1.max() <= 1.0
    assert torch.equal(y1, y2) and not torch.equal(y1, y3)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(tf(x, generator=g1), tf(x, generator=g2))


def test_seeded_call_leaves_global_rng_alone():
    tf = build_train_transform(TransformConfig(image_size=28, channels=1))
    torch.manual_seed(0)
    a = torch.rand(3)
    torch.manual_seed(0)
    tf(_batch(), seed=1)
    assert torch.equal(torch.rand(3), a)


def test_grey_to_three_channels_and_back():
    x = _batch(c=1)
    y = build_train_transform(TransformConfig(image_size=28, channels=3, inception_crop=False, hflip=False))(x)
    assert y.shape == (16, 3, 28, 28)
    assert torch.equal(y[:, 0], y[:, 1]) and torch.equal(y[:, 1], y[:, 2])
    rgb = _batch(c=3)
    e = build_eval_transform(TransformConfig(image_size=28, channels=1))(rgb)
    # ITU-R 601 luma exactly as Pillow's Image.convert("L") computes it (what predict / serve use on a file)
    r, g, b = (rgb[:, i].to(torch.int64) for i in range(3))
    luma = ((19595 * r + 38470 * g + 7471 * b + 32768) >> 16).float()
    assert torch.allclose(e[:, 0], luma / 127.5 - 1, atol=1e-5)


def test_no_crop_no_flip_is_plain_resize_to_minus_one_one():
    x = _batch(size=20)
    cfg = TransformConfig(image_size=28, channels=1, inception_crop=False, hflip=False)
    y = build_train_transform(cfg)(x, seed=0)
    ref = F.interpolate(x.float(), size=(28, 28), mode="bilinear", align_corners=False, antialias=True)
    assert torch.allclose(y, ref / 127.5 - 1.0, atol=1e-5)


def test_flip_only_gives_original_or_mirror():
    x = _batch(n=64)
    cfg = TransformConfig(image_size=28, channels=1, inception_crop=False, hflip=True)
    y = build_train_transform(cfg)(x, seed=3)
    ref = x.float() / 127.5 - 1
    same = (y == ref).flatten(1).all(1)
    mirrored = (y == ref.flip(-1)).flatten(1).all(1)
    assert bool((same | mirrored).all())
    assert 10 < int(mirrored.sum()) < 54  # about half


def _shifted(img: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """Reference: content moved down by dy and right by dx, vacated pixels zero (plain slicing)."""
    out = torch.zeros_like(img)
    h, w = img.shape[-2:]
    out[..., max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = \
        img[..., max(-dy, 0):h + min(-dy, 0), max(-dx, 0):w + min(-dx, 0)]
    return out


def test_random_shift_is_an_exact_zero_filled_translation():
    x = torch.rand(200, 3, 9, 7) + 1.0  # no zeros in the content, so the fill is recognisable
    y = random_shift(x, 2, generator=torch.Generator().manual_seed(0))
    seen = set()
    for img, out in zip(x, y):
        matches = [(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3) if torch.equal(out, _shifted(img, dy, dx))]
        assert len(matches) == 1
        seen.add(matches[0])
    assert len(seen) == 25  # every offset in [-2, 2]^2 occurs


def test_random_shift_in_train_transform_keeps_range_and_is_seeded():
    cfg = TransformConfig(image_size=28, channels=1, inception_crop=False, hflip=False, random_shift=3)
    tf = build_train_transform(cfg)
    x = _batch(n=32)
    y = tf(x, seed=1)
    assert y.shape == (32, 1, 28, 28) and torch.equal(y, tf(x, seed=1))
    assert not torch.equal(y, tf(x, seed=2))
    assert float(y.min()) >= -1 and float(y.max()) <= 1


def test_inception_crop_boxes_respect_area_and_aspect():
    boxes = sample_crop_boxes(4000, 200, 300, (0.05, 1.0), (3 / 4, 4 / 3), generator=torch.Generator().manual_seed(0))
    x0, y0, w, h = boxes.T.double()
    assert bool((x0 >= 0).all() and (y0 >= 0).all() and (x0 + w <= 300).all() and (y0 + h <= 200).all())
    whole = (w == 300) & (h == 200)
    area, ratio = (w * h / 60000)[~whole], (w / h)[~whole]
    assert float(area.min()) >= 0.045 and float(area.max()) <= 1.0
    assert float(ratio.min()) >= 0.73 and float(ratio.max()) <= 1.37
    assert 0.3 < float(area.mean()) < 0.7  # roughly uniform on [0.05, 1] among the boxes that fit


def test_crop_resize_equals_slice_and_interpolate():
    x = _batch(n=12, c=3, size=30).float()
    boxes = sample_crop_boxes(12, 30, 30, generator=torch.Generator().manual_seed(1))
    out = crop_resize(x, boxes, (24, 24))
    for i, (x0, y0, w, h) in enumerate(boxes.tolist()):
        ref = F.interpolate(x[i:i + 1, :, y0:y0 + h, x0:x0 + w], size=(24, 24), mode="bilinear", align_corners=False)
        assert torch.allclose(out[i], ref[0], atol=1e-3)


def test_eval_resize_and_center_crop_reference():
    x = _batch(n=4, c=3, size=40)
    pre = Preprocess(image_size=(28, 28), resize=32, channels=3)
    y = build_eval_transform(pre)(x)
    r = F.interpolate(x.float(), size=(32, 32), mode="bilinear", align_corners=False, antialias=True)
    ref = r[..., 2:30, 2:30] / 127.5 - 1
    assert torch.allclose(y, ref, atol=1e-5)
    cf = TransformConfig(image_size=28, channels=3, crop_fraction=0.875).preprocess()
    assert cf.effective_resize == 32
    assert torch.allclose(build_eval_transform(cf)(x), y)


def test_mean_std_normalisation():
    x = torch.full((2, 3, 8, 8), 51, dtype=torch.uint8)  # 0.2 on the [0, 1] scale
    pre = Preprocess(image_size=8, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    y = pre.batch(x)
    ref = (0.2 - torch.tensor([0.485, 0.456, 0.406])) / torch.tensor([0.229, 0.224, 0.225])
    assert torch.allclose(y[0, :, 0, 0], ref, atol=1e-5)


def test_preprocess_single_image_and_roundtrip():
    arr = (np.arange(30 * 50 * 3) % 256).astype(np.uint8).reshape(30, 50, 3)
    pre = Preprocess(image_size=(16, 16), crop_fraction=0.8, channels=3)
    y = pre(Image.fromarray(arr))
    assert y.shape == (3, 16, 16) and y.min() >= -1 and y.max() <= 1
    batch = pre.batch(torch.from_numpy(arr).permute(2, 0, 1)[None])
    assert torch.allclose(y, batch[0])
    assert Preprocess.from_dict(pre.to_dict()) == pre


def test_randaugment_and_erasing_shapes_range_determinism():
    x = _batch(n=8, c=3, size=32)
    tf = build_train_transform(TransformConfig(image_size=32, channels=3, randaugment=(2, 9), random_erasing=1.0))
    a, b = tf(x, seed=11), tf(x, seed=11)
    assert a.shape == (8, 3, 32, 32) and torch.equal(a, b)
    assert a.min() >= -1.0 and a.max() <= 1.0
    assert bool(((a == 0).flatten(1).sum(1) > 0).all())  # erasing writes zeros (the mean) in every image
    grey = build_train_transform(TransformConfig(image_size=28, channels=1, randaugment=(2, 9)))
    for s in range(5):
        assert grey(_batch(n=4), seed=s).shape == (4, 1, 28, 28)
    for m in (0, 30):  # AugReg's light1 is randaug(2, 0); kornia's own range is open at both ends
        assert build_train_transform(TransformConfig(image_size=8, channels=3, randaugment=(2, m)))(
            _batch(n=2, c=3, size=8), seed=0).shape == (2, 3, 8, 8)


@pytest.mark.parametrize("mode", ["mixup", "cutmix"])
def test_mix_batch_soft_targets(mode):
    x = torch.randn(8, 1, 16, 16)
    y = torch.arange(8) % 4
    kw = {"mixup_alpha": 0.8} if mode == "mixup" else {"cutmix_alpha": 1.0}
    mixed, t = mix_batch(x, y, 4, seed=3, **kw)
    assert t.shape == (8, 4) and torch.allclose(t.sum(1), torch.ones(8))
    lam = float(t[0, y[0]]) if y[0] != y[-1] else None
    other = x.roll(1, 0)
    if mode == "mixup":
        assert lam is not None and 0.5 <= lam <= 1.0
        assert torch.allclose(mixed, lam * x + (1 - lam) * other, atol=1e-6)
    else:
        from_other = (mixed == other) & (mixed != x)
        frac = float(from_other[0].float().mean())
        assert math.isclose(1 - lam, frac, abs_tol=1e-6)
    again, t2 = mix_batch(x, y, 4, seed=3, **kw)
    assert torch.equal(again, mixed) and torch.equal(t2, t)


def test_mix_batch_off_gives_one_hot_with_smoothing():
    x = torch.randn(4, 1, 8, 8)
    mixed, t = mix_batch(x, torch.tensor([0, 1, 2, 0]), 3, label_smoothing=0.3)
    assert torch.equal(mixed, x)
    assert torch.allclose(t[0], torch.tensor([0.8, 0.1, 0.1]))


def test_transform_config_roundtrip_and_digits_no_flip():
    cfg = TransformConfig(image_size=28, channels=1, randaugment=(2, 10), mixup=0.2)
    assert TransformConfig.from_dict(cfg.to_dict()) == cfg
    assert TransformConfig.for_source("digits", 8, 1).hflip is False
    assert TransformConfig.for_source("mnist:/x", 28, 1).hflip is False
    assert TransformConfig.for_source("fashion-mnist", 28, 1).hflip is True
