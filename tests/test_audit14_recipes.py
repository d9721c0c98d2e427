"""Audit of the paper's training recipes against the official code (google-research/vision_transformer,
big_vision, optax): the schedule, the optimisers, clipping, the recipes' regularisation, and the inception crop
of the official input pipelines (TF's sample_distorted_bounding_box)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn

from vitlab.train.config import resolve_config
from vitlab.train.optim import build_optimizer, build_scheduler, lr_factor


# ------------------------------------------------------------------------------------------- schedule
def vt_schedule(step, total, base, decay, warmup, end):
    """vit_jax/utils.py create_learning_rate_schedule, as written there (numpy for jnp)."""
    progress = np.clip((step - warmup) / float(total - warmup), 0.0, 1.0)
    lr = end + (base - end) * (1.0 - progress) if decay == "linear" else base * 0.5 * (1.0 + np.cos(np.pi * progress))
    return lr * min(1.0, step / warmup) if warmup else lr


@pytest.mark.parametrize("decay,base,end", [("cosine", 0.03, 0.0), ("linear", 1e-3, 1e-5)])
def test_schedule_is_the_official_one_at_the_boundaries(decay, base, end):
    """optax calls the schedule with its update count, 0 for the first update (train.py: optax.sgd(lr_fn)):
    LambdaLR's step s is that count. So update 0 runs at lr 0, update `warmup` at the peak, and the last update
    (total - 1) just above the end value (the decay reaches it one step after the run)."""
    total, warmup = 50, 10
    net = nn.Linear(2, 2)
    opt = build_optimizer(net, "sgd", base)
    sched = build_scheduler(opt, total, warmup, decay, base, end)
    used = []
    for _ in range(total):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    for s in (0, 1, warmup - 1, warmup, warmup + 1, total - 1):
        assert used[s] == pytest.approx(vt_schedule(s, total, base, decay, warmup, end), rel=1e-9, abs=1e-12)
    assert used[0] == 0.0 and used[warmup] == pytest.approx(base)
    last = end + (base - end) / (total - warmup) if decay == "linear" else base * 0.5 * (1 + math.cos(math.pi * 39 / 40))
    assert used[-1] == pytest.approx(last)
    assert lr_factor(total, total, warmup, decay, base, end) * base == pytest.approx(end, abs=1e-12)


# ------------------------------------------------------------------------------------------ optimisers
def _torch_run(name, lr, wd, decay, end, grads, init):
    w, b = nn.Parameter(torch.tensor(init[0])), nn.Parameter(torch.tensor(init[1]))
    opt = build_optimizer([{"params": [w], "weight_decay": wd}, {"params": [b], "weight_decay": 0.0}], name, lr, wd)
    sched = build_scheduler(opt, len(grads), 4, decay, lr, end)
    for gw, gb in grads:
        w.grad, b.grad = torch.tensor(gw), torch.tensor(gb)
        torch.nn.utils.clip_grad_norm_([w, b], 1.0)  # what loop.clip_grad_norm does over all parameters
        opt.step()
        sched.step()
    return w.detach().double().numpy(), b.detach().double().numpy()


def _clip(gs):  # optax.clip_by_global_norm(1.0)
    norm = math.sqrt(sum(float((g ** 2).sum()) for g in gs))
    return [g * min(1.0, 1.0 / norm) for g in gs]


def _data():
    rng = np.random.default_rng(0)
    init = (rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=4).astype(np.float32))
    grads = [(rng.normal(size=(3, 4)).astype(np.float32) * 3, rng.normal(size=4).astype(np.float32) * 3)
             for _ in range(12)]
    return grads, init


def test_sgd_is_optax_sgd_momentum_after_global_clipping():
    """VT train.py: optax.chain(clip_by_global_norm(1), sgd(lr_fn, momentum=0.9)): t = g + 0.9 t; p -= lr(count) t.
    (Also run against optax 0.2.8 itself during the audit: max |diff| 1.2e-7.)"""
    grads, init = _data()
    tw, tb = _torch_run("sgd", 0.03, 0.0, "cosine", 0.0, grads, init)
    p = [init[0].astype(np.float64), init[1].astype(np.float64)]
    tr = [np.zeros_like(p[0]), np.zeros_like(p[1])]
    for count, g in enumerate(grads):
        g = _clip([x.astype(np.float64) for x in g])
        lr = vt_schedule(count, 12, 0.03, "cosine", 4, 0.0)
        tr = [gi + 0.9 * ti for gi, ti in zip(g, tr)]
        p = [pi - lr * ti for pi, ti in zip(p, tr)]
    assert np.abs(tw - p[0]).max() < 1e-5 and np.abs(tb - p[1]).max() < 1e-5


def test_adamw_is_big_vision_decoupled_decay_on_kernels():
    """big_vision optax.py: clip -> scale_by_adam -> scale(lr) -> add_decayed_weights(wd_bv, kernels) ->
    scale_by_schedule -> scale(-1): p -= sched (lr adam + wd_bv p). The paper's wd is wd_bv / lr, so AdamW(lr,
    weight_decay=paper wd) is the same update; biases get none."""
    grads, init = _data()
    lr, wd, end = 1e-2, 0.1, 1e-5
    tw, tb = _torch_run("adamw", lr, wd, "linear", end, grads, init)
    p = [init[0].astype(np.float64), init[1].astype(np.float64)]
    mu = [np.zeros_like(x) for x in p]
    nu = [np.zeros_like(x) for x in p]
    for count, g in enumerate(grads):
        g = _clip([x.astype(np.float64) for x in g])
        mu = [0.9 * m + 0.1 * gi for m, gi in zip(mu, g)]
        nu = [0.999 * v + 0.001 * gi ** 2 for v, gi in zip(nu, g)]
        t = count + 1
        adam = [(m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8) for m, v in zip(mu, nu)]
        sched = vt_schedule(count, 12, 1.0, "linear", 4, end / lr)
        p = [p[0] - sched * (lr * adam[0] + wd * lr * p[0]), p[1] - sched * (lr * adam[1])]
    assert np.abs(tw - p[0]).max() < 1e-5 and np.abs(tb - p[1]).max() < 1e-5


# ---------------------------------------------------------------------------------------------- recipes
def test_paper_recipes_have_no_deit_regularisation():
    """Paper B.1 / B.1.1 and VT#142: no label smoothing, mixup, RandAugment or stochastic depth; only the
    inception crop and flips. Pre-training: Adam, decay 0.1, linear to 1e-5, clip 1; fine-tuning: SGD 0.9, no decay,
    cosine, clip 1, zero head."""
    for name in ("pretrain", "finetune"):
        cfg = resolve_config(name)
        assert cfg.label_smoothing == 0 and cfg.mixup == 0 and cfg.cutmix == 0 and cfg.randaugment is None
        assert cfg.drop_path is None and cfg.random_erasing == 0 and cfg.random_shift == 0 and cfg.grad_clip == 1.0
        assert cfg.inception_crop and tuple(cfg.crop_scale) == (0.05, 1.0)
    pre, ft = resolve_config("pretrain"), resolve_config("finetune")
    assert (pre.optimizer, tuple(pre.betas), pre.weight_decay, pre.decay, pre.lr_end) == \
        ("adamw", (0.9, 0.999), 0.1, "linear", 1e-5)
    assert (ft.optimizer, ft.momentum, ft.weight_decay, ft.decay, ft.zero_head) == ("sgd", 0.9, 0.0, "cosine", True)


# ------------------------------------------------------------------------------------- inception crop
def tf_crop_reference(rng, height, width, scale=(0.05, 1.0), ratio=(0.75, 1.33), attempts=100):
    """tensorflow/core/kernels/image/sample_distorted_bounding_box_op.cc, one image, line by line."""
    lrint = lambda v: int(np.rint(np.float32(v)))  # noqa: E731 - half to even, as lrintf
    min_area, max_area = scale[0] * width * height, scale[1] * width * height
    for _ in range(attempts):
        r = np.float32(rng.random() * (ratio[1] - ratio[0]) + ratio[0])
        h = lrint(math.sqrt(min_area / r))
        max_h = lrint(math.sqrt(max_area / r))
        if lrint(max_h * r) > width:
            max_h = int((width + 0.5 - 1e-7) / r)
            if lrint(max_h * r) > width:
                max_h -= 1
        max_h = min(max_h, height)
        h = min(h, max_h)
        if h < max_h:
            h += int(rng.integers(0, max_h - h + 1))
        w = lrint(h * r)
        if w * h < min_area:
            h += 1
            w = lrint(h * r)
        if w * h > max_area:
            h -= 1
            w = lrint(h * r)
        if min_area <= w * h <= max_area and 0 < w <= width and 0 < h <= height:
            y = int(rng.integers(0, height - h)) if h < height else 0
            x = int(rng.integers(0, width - w)) if w < width else 0
            return x, y, w, h
    return 0, 0, width, height


def test_tf_crop_sampler_follows_tensorflows_sample_distorted_bounding_box():
    from vitlab.data.transforms import sample_tf_crop_boxes

    n, H, W = 20000, 120, 160
    ours = sample_tf_crop_boxes(n, H, W, (0.05, 1.0), (0.75, 1.33), generator=torch.Generator().manual_seed(0))
    ours = ours.numpy().astype(np.float64)
    rng = np.random.default_rng(0)
    ref = np.array([tf_crop_reference(rng, H, W) for _ in range(n)], dtype=np.float64)
    for arr in (ours, ref):
        assert (arr[:, 0] >= 0).all() and (arr[:, 1] >= 0).all()
        assert (arr[:, 0] + arr[:, 2] <= W).all() and (arr[:, 1] + arr[:, 3] <= H).all()
    area, ref_area = ours[:, 2] * ours[:, 3] / (H * W), ref[:, 2] * ref[:, 3] / (H * W)
    aspect, ref_aspect = ours[:, 2] / ours[:, 3], ref[:, 2] / ref[:, 3]
    for q in (0.1, 0.25, 0.5, 0.75, 0.9):
        assert abs(np.quantile(area, q) - np.quantile(ref_area, q)) < 0.015
        assert abs(np.quantile(aspect, q) - np.quantile(ref_aspect, q)) < 0.015
    assert abs(area.mean() - ref_area.mean()) < 0.01
    # TF's offset is Uniform(W - w): a narrower box never touches the right edge
    narrow = ours[:, 2] < W
    assert (ours[narrow, 0] + ours[narrow, 2] <= W - 1).all()


def _crop_areas(recipe: str, n: int = 3000, side: int = 100) -> np.ndarray:
    """The area fractions of the training crops that the recipe's train transform cuts, read back from images
    whose channels hold the pixel's column and row (the crop is upsampled, so its edge pixels appear as such)."""
    from vitlab.train.setup import build_transforms

    cfg = resolve_config(recipe, overrides={"data": "bundled", "image_size": side, "hflip": False})
    data = SimpleNamespace(train=SimpleNamespace(image_size=(side, side)), channels=3)
    _, train_tf, _, _ = build_transforms(cfg, nn.Linear(1, 1), data, None, torch.device("cpu"))
    ramp = torch.arange(side, dtype=torch.uint8)
    img = torch.stack([ramp.view(1, -1).expand(side, side), ramp.view(-1, 1).expand(side, side),
                       torch.zeros(side, side, dtype=torch.uint8)])
    out = train_tf(img.expand(n, -1, -1, -1).contiguous(), seed=0)
    pix = torch.round((out * 0.5 + 0.5) * 255)  # the recipes' mean / std 0.5 undone
    w = pix[:, 0].amax((1, 2)) - pix[:, 0].amin((1, 2)) + 1
    h = pix[:, 1].amax((1, 2)) - pix[:, 1].amin((1, 2)) + 1
    return (w * h / side**2).numpy()


@pytest.mark.parametrize("recipe", ["pretrain", "finetune"])
def test_paper_recipes_crop_as_the_official_pipeline(recipe):
    """vit_jax/input_pipeline.py crops with tf.image.sample_distorted_bounding_box(area_range=(0.05, 1)): its height
    and its aspect uniform, so the mean crop covers 0.375 of a square image (median 0.33); torchvision's
    RandomResizedCrop (uniform area, what these recipes used before) covers 0.466 (median 0.46)."""
    rng = np.random.default_rng(1)
    ref = np.array([tf_crop_reference(rng, 100, 100) for _ in range(20000)])
    ref_mean = float((ref[:, 2] * ref[:, 3]).mean() / 100**2)
    areas = _crop_areas(recipe)
    assert abs(ref_mean - 0.375) < 0.01
    assert abs(areas.mean() - ref_mean) < 0.02, areas.mean()


def test_small_data_recipe_keeps_torchvisions_crop():
    """The DeiT-style recipe and its presets (documented results) keep RandomResizedCrop's definition."""
    for name in ("small-data", "demo", "fashion-mnist"):
        assert resolve_config(name).crop_sampler == "torchvision"


def test_resume_of_a_run_recorded_before_crop_sampler_keeps_its_crops(tmp_path):
    """A finetune run's config.yaml from before the setting has no crop_sampler: it trained with torchvision's
    boxes, and its resume must go on with them (the recipe's new default would change the run mid-way).
    tests/test_resume_added_later.py has the command line's side."""
    import yaml

    from vitlab.train.resume import check_run_settings

    run = tmp_path / "run"
    run.mkdir()
    recorded = {k: v for k, v in resolve_config("finetune").to_dict().items() if k != "crop_sampler"}
    (run / "config.yaml").write_text(yaml.safe_dump(recorded, sort_keys=False))
    cfg = resolve_config("finetune", overrides={"resume": str(run)})
    assert cfg.crop_sampler == "torchvision"
    assert check_run_settings(cfg, (), recorded) == {}
    cfg2 = resolve_config("finetune")
    cfg2.resume = "somewhere"
    check_run_settings(cfg2, (), cfg2.to_dict())  # a run recorded with the setting keeps its value
    assert cfg2.crop_sampler == "tf"
