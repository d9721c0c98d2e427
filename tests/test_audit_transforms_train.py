"""Audit: training augmentation numerics against their definitions (vitlab.data.transforms).

Reference values are the definitions written out here in numpy; the distribution checks were also run against
torchvision 0.29.1's RandomResizedCrop.get_params (20,000 draws each, /work/peers): on square images the area
and log-aspect distributions agree (two-sample KS p > 0.4); on elongated images vitlab falls back to the whole
image after 10 misses (TF's sample_distorted_bounding_box, as documented) where torchvision takes a centre crop.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from vitlab.data.preprocess import Preprocess
from vitlab.data.transforms import TrainTransform, TransformConfig, mix_batch, sample_crop_boxes


def checkerboard(n: int = 2, size: int = 12) -> torch.Tensor:
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    board = (((yy // 2 + xx // 2) % 2) * 255).to(torch.uint8)
    return board.expand(n, 3, size, size).contiguous()


def test_plain_resize_training_equals_eval_also_for_bicubic():
    """Without crop and flip, training's resize is the evaluation's: bicubic overshoot clipped to 0..255 in both
    (as PIL clips), so training inputs stay in [-1, 1] like the evaluation's."""
    x = checkerboard()
    cfg = TransformConfig(image_size=40, channels=3, inception_crop=False, hflip=False, interpolation="bicubic")
    train = TrainTransform(cfg)(x, seed=0)
    evaluated = Preprocess(image_size=(40, 40), interpolation="bicubic").batch(x)
    assert train.min() >= -1.0 and train.max() <= 1.0
    assert torch.equal(train, evaluated)


def test_inception_crop_area_and_log_aspect_follow_the_definition():
    """Square image, scale (0.08, 1), ratio (3/4, 4/3): area fraction ~U(scale), log aspect ~U(log ratio), the
    first of 10 draws that fits (w <= W, h <= H) is kept. The reference is that definition drawn in numpy
    (continuous, no pixel rounding); torchvision's get_params gives the same mean area, 0.481 (0.483 here)."""
    n, side = 20000, 200
    b = sample_crop_boxes(n, side, side, (0.08, 1.0), (3 / 4, 4 / 3), generator=torch.Generator().manual_seed(0))
    b = b.numpy().astype(np.float64)
    area = b[:, 2] * b[:, 3] / side**2
    logr = np.log(b[:, 2] / b[:, 3])
    rng = np.random.default_rng(0)
    frac = rng.uniform(0.08, 1.0, (200000, 10))
    lr = rng.uniform(math.log(3 / 4), math.log(4 / 3), (200000, 10))
    fits = (np.sqrt(frac * np.exp(lr)) <= 1) & (np.sqrt(frac / np.exp(lr)) <= 1)
    first = fits.argmax(1)
    ref_area = frac[np.arange(200000), first]
    ref_lr = lr[np.arange(200000), first]
    assert abs(area.mean() - ref_area.mean()) < 0.01
    for q in (0.1, 0.5, 0.9):
        assert abs(np.quantile(area, q) - np.quantile(ref_area, q)) < 0.015
        assert abs(np.quantile(np.abs(logr), q) - np.quantile(np.abs(ref_lr), q)) < 0.015
    assert (b[:, 0] >= 0).all() and (b[:, 0] + b[:, 2] <= side).all() and (b[:, 1] + b[:, 3] <= side).all()


def test_cutmix_lambda_is_the_kept_area_after_clipping_and_mixup_is_folded():
    labels = torch.tensor([0, 1])
    imgs = torch.stack([torch.zeros(1, 10, 13), torch.ones(1, 10, 13)])
    for s in range(300):
        m, t = mix_batch(imgs, labels, 2, cutmix_alpha=1.0, seed=s)
        assert abs((1 - m[0].mean().item()) - t[0, 0].item()) < 1e-6  # lambda = pixels of image 0 kept
        assert torch.allclose(t.sum(1), torch.ones(2))
        m, t = mix_batch(imgs, labels, 2, mixup_alpha=0.4, seed=s)
        lam = t[0, 0].item()
        assert lam >= 0.5 and torch.allclose(m[0], torch.full_like(m[0], 1 - lam), atol=1e-6)
