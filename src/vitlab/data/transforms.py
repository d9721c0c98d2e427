"""Batched, seeded image transforms that run on the training device (uint8 batch in, float batch out).

Training (the paper's fine-tuning recipe, reference section 4.3): inception crop (area 5-100 %,
aspect 3/4-4/3) resized to the model size + horizontal flip, values in [-1, 1]. Its box comes from torchvision's
RandomResizedCrop definition (`sample_crop_boxes`) or, as the official pipelines and the paper's recipes, from
TF's sample_distorted_bounding_box (`sample_tf_crop_boxes`; `TransformConfig.crop_sampler`). Optional: RandAugment
and random erasing (kornia), mixup / cutmix with soft targets (`mix_batch`). Evaluation: resize +
centre crop or the official plain resize (`Preprocess.batch`).

The inception crop is written here (one `grid_sample` call for the whole batch) because kornia's
RandomResizedCrop crops sample by sample and measured 3.3x slower on a CPU (docs/benchmarks.md); like TF's resize in the
official pipeline it does not anti-alias.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vitlab.data.preprocess import Preprocess, _pair, _per_channel, match_channels, resize_batch

# Sources whose meaning changes when mirrored: no horizontal flip by default.
NO_FLIP_SOURCES = ("mnist", "digits")
# The inception crop's box samplers (TransformConfig.crop_sampler).
CROP_SAMPLERS = ("torchvision", "tf")


@dataclass
class TransformConfig:
    """Everything the train and eval transforms need; stored in a run's config."""

    image_size: int | tuple[int, int] = 224
    channels: int = 3
    mean: float | tuple[float, ...] = 0.5  # on the [0, 1] scale; 0.5/0.5 gives [-1, 1]
    std: float | tuple[float, ...] = 0.5
    # training augmentation
    inception_crop: bool = True  # False: plain resize to image_size
    crop_scale: tuple[float, float] = (0.05, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    # How the inception crop draws its box: "torchvision" (RandomResizedCrop: area ~ U(scale), log aspect ~ U,
    # 10 tries) or "tf" (TF's sample_distorted_bounding_box, which the official pipelines call: aspect ~ U,
    # height ~ U, 100 tries; smaller crops: mean area 0.375 of a square image against 0.466 at scale 0.05-1).
    crop_sampler: str = "torchvision"
    hflip: bool = True
    # Random translation by up to N pixels (zero padding, then a random crop back to size): the
    # standard light augmentation for 28-32 px data such as Fashion-MNIST and CIFAR.
    random_shift: int = 0
    randaugment: tuple[int, int] | None = None  # (n ops, magnitude 0-30), kornia's RandAugment
    random_erasing: float = 0.0  # probability per image
    mixup: float = 0.0  # Beta(alpha, alpha); 0 = off
    cutmix: float = 0.0
    mix_prob: float = 1.0
    mix_switch_prob: float = 0.5  # with both on: chance of cutmix instead of mixup
    # evaluation
    eval_resize: int | None = None  # shorter side before the centre crop; None: see crop_fraction
    crop_fraction: float = 1.0  # < 1: resize to floor(image_size / crop_fraction) (timm) then centre crop; 1: plain resize
    interpolation: str = "bilinear"

    def __post_init__(self) -> None:
        self.image_size = _pair(self.image_size)
        self.mean = _per_channel(self.mean, self.channels)
        self.std = _per_channel(self.std, self.channels)
        self.crop_scale = tuple(float(v) for v in self.crop_scale)
        self.crop_ratio = tuple(float(v) for v in self.crop_ratio)
        if self.crop_sampler not in CROP_SAMPLERS:
            from vitlab.errors import VitlabError

            raise VitlabError(f"crop_sampler must be {' or '.join(CROP_SAMPLERS)}, got {self.crop_sampler!r}")
        if self.randaugment is not None:
            self.randaugment = tuple(int(v) for v in self.randaugment)
            n, m = self.randaugment
            if not (n >= 1 and 0 <= m <= 30):
                from vitlab.errors import VitlabError

                raise VitlabError(f"randaugment (n, m) needs n >= 1 and 0 <= m <= 30, got ({n}, {m})")

    def preprocess(self) -> Preprocess:
        """The evaluation preprocessing as the record saved next to the weights.

        A model trained here learnt from stored squares (every file source keeps an image's centre square,
        `images.resize_shorter_center_crop`), so its record resizes the shorter side and cuts the centre square
        where the evaluation would otherwise be a plain resize: recorded as a plain resize, `predict`, `serve`
        and the ONNX export squashed a non-square photo the model had only ever seen cropped (98.6 % in
        `evaluate` against 91.7 % in `predict` on the same files). A square image gives the same input either way."""
        size = tuple(self.image_size) if isinstance(self.image_size, tuple | list) else (self.image_size,) * 2
        resize = self.eval_resize
        if resize is None and self.crop_fraction >= 1.0 and size[0] == size[1]:
            resize = int(size[0])
        return Preprocess(image_size=self.image_size, mean=self.mean, std=self.std, resize=resize,
                          crop_fraction=self.crop_fraction, interpolation=self.interpolation, channels=self.channels)

    @property
    def mixing(self) -> bool:
        return (self.mixup > 0 or self.cutmix > 0) and self.mix_prob > 0

    def to_dict(self) -> dict:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TransformConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in known})

    @classmethod
    def for_source(cls, source: str, image_size, channels: int, **overrides) -> TransformConfig:
        """Defaults for a data source: no flip for digits (a mirrored 2 is not a 2)."""
        name = str(source).split(":")[0].lower()
        if name in NO_FLIP_SOURCES and "hflip" not in overrides:
            overrides["hflip"] = False
        return cls(image_size=image_size, channels=channels, **overrides)


def sample_crop_boxes(n: int, height: int, width: int, scale: Sequence[float] = (0.05, 1.0),
                      ratio: Sequence[float] = (3 / 4, 4 / 3), attempts: int = 10,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Inception-crop boxes (x0, y0, w, h) in whole pixels, (n, 4) int64 on the CPU.

    Per image: area fraction ~ U(scale), log aspect ~ U(log ratio); the first of `attempts` draws that
    fits is used, else the whole image (TF's sample_distorted_bounding_box behaviour).
    """
    area = height * width
    frac = torch.empty(n, attempts).uniform_(scale[0], scale[1], generator=generator)
    logr = torch.empty(n, attempts).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=generator)
    r = torch.exp(logr)
    w = torch.round(torch.sqrt(frac * area * r))
    h = torch.round(torch.sqrt(frac * area / r))
    ok = (w >= 1) & (h >= 1) & (w <= width) & (h <= height)
    first = torch.where(ok.any(1), ok.float().argmax(1), torch.full((n,), -1))
    rows = torch.arange(n)
    pick = first.clamp(min=0)
    bw = torch.where(first >= 0, w[rows, pick], torch.full((n,), float(width))).long()
    bh = torch.where(first >= 0, h[rows, pick], torch.full((n,), float(height))).long()
    u = torch.rand(n, 2, generator=generator)
    x0 = torch.floor(u[:, 0] * (width - bw + 1).double()).long().clamp(max=width - 1)
    y0 = torch.floor(u[:, 1] * (height - bh + 1).double()).long().clamp(max=height - 1)
    x0 = torch.minimum(x0, width - bw)
    y0 = torch.minimum(y0, height - bh)
    return torch.stack([x0, y0, bw, bh], dim=1)


def sample_tf_crop_boxes(n: int, height: int, width: int, scale: Sequence[float] = (0.05, 1.0),
                         ratio: Sequence[float] = (0.75, 1.33), attempts: int = 100,
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """Inception-crop boxes (x0, y0, w, h) drawn as TF's `sample_distorted_bounding_box` draws them, which the
    official input pipelines call (vit_jax/input_pipeline.py `_pp`, big_vision pp/ops_image.py `inception_crop`:
    area_range=(0.05, 1), min_object_covered=0, TF's default aspect range (0.75, 1.33) and 100 attempts).

    Written out from tensorflow/core/kernels/image/sample_distorted_bounding_box_op.cc `GenerateRandomCrop`,
    because its distribution is not torchvision's: per attempt aspect r ~ U(ratio) (not log-uniform), then the
    height uniform over the whole pixels from round(sqrt(min_area / r)) to round(sqrt(max_area / r)) (capped to
    the image; so the area is not uniform), w = round(h r), one pixel up or down to meet the area bounds; the
    first attempt that fits is used, else the whole image. The offset is uniform over [0, H - h) ([0, 0] when
    h == H), as TF's `Uniform(H - h)`. lrintf rounds half to even, as torch.round."""
    total = float(height * width)
    min_area, max_area = scale[0] * total, scale[1] * total
    r = torch.empty(n, attempts).uniform_(float(ratio[0]), float(ratio[1]), generator=generator)
    u = torch.rand(n, attempts, generator=generator)
    h = torch.round(torch.sqrt(min_area / r))
    max_h = torch.round(torch.sqrt(max_area / r))
    # the largest height whose width round(h r) still fits the image (TF's correction, kEps = 1e-7)
    too_wide = torch.round(max_h * r) > width
    fixed = torch.floor((width + 0.5 - 1e-7) / r)
    fixed = torch.where(torch.round(fixed * r) > width, fixed - 1, fixed)
    max_h = torch.where(too_wide, fixed, max_h).clamp(max=height)
    h = torch.minimum(h, max_h)
    h = h + torch.floor(u * (max_h - h + 1)).clamp(max=(max_h - h).clamp(min=0))  # uniform on [h, max_h]
    w = torch.round(h * r)
    area = w * h
    h = torch.where(area < min_area, h + 1, h)
    w = torch.round(h * r)
    area = w * h
    h = torch.where(area > max_area, h - 1, h)
    w = torch.round(h * r)
    area = w * h
    ok = (area >= min_area) & (area <= max_area) & (w <= width) & (h <= height) & (w > 0) & (h > 0)
    first = torch.where(ok.any(1), ok.float().argmax(1), torch.full((n,), -1))
    rows, pick = torch.arange(n), first.clamp(min=0)
    bw = torch.where(first >= 0, w[rows, pick], torch.full((n,), float(width))).long()
    bh = torch.where(first >= 0, h[rows, pick], torch.full((n,), float(height))).long()
    off = torch.rand(n, 2, generator=generator).double()
    x0 = torch.floor(off[:, 0] * (width - bw).double()).long().clamp(min=0)
    y0 = torch.floor(off[:, 1] * (height - bh).double()).long().clamp(min=0)
    x0 = torch.minimum(x0, (width - bw - 1).clamp(min=0))
    y0 = torch.minimum(y0, (height - bh - 1).clamp(min=0))
    return torch.stack([x0, y0, bw, bh], dim=1)


def crop_resize(x: torch.Tensor, boxes: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Cut box (x0, y0, w, h) of each image and resize it bilinearly to `size` in one grid_sample call.

    Equal to slicing each crop and calling F.interpolate(bilinear, align_corners=False): sample
    positions are clamped to the crop, so no pixel outside it leaks in.
    """
    b, _, height, width = x.shape
    oh, ow = size
    bx = boxes.to(device=x.device, dtype=torch.float32)
    x0, y0, bw, bh = bx[:, 0:1], bx[:, 1:2], bx[:, 2:3], bx[:, 3:4]
    jx = torch.arange(ow, device=x.device, dtype=torch.float32)[None] + 0.5
    jy = torch.arange(oh, device=x.device, dtype=torch.float32)[None] + 0.5
    px = (jx * bw / ow - 0.5).clamp(min=0) + x0  # pixel-index coordinates, as F.interpolate computes them
    py = (jy * bh / oh - 0.5).clamp(min=0) + y0
    px = torch.minimum(px, x0 + bw - 1)
    py = torch.minimum(py, y0 + bh - 1)
    gx = (2 * px + 1) / width - 1
    gy = (2 * py + 1) / height - 1
    grid = torch.stack([gx[:, None, :].expand(b, oh, ow), gy[:, :, None].expand(b, oh, ow)], dim=-1)
    return F.grid_sample(x, grid.to(x.dtype), mode="bilinear", padding_mode="border", align_corners=False)


def random_shift(x: torch.Tensor, pixels: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Shift each image by a random whole-pixel offset in [-pixels, pixels] per axis, filling with 0.

    Zero-pad by `pixels`, then cut a random (H, W) window per image with one indexing gather (a pure copy).
    """
    b, c, h, w = x.shape
    padded = F.pad(x, (pixels, pixels, pixels, pixels))
    offsets = torch.randint(0, 2 * pixels + 1, (b, 2), generator=generator).to(x.device)
    rows = offsets[:, 0, None] + torch.arange(h, device=x.device)  # (B, H)
    cols = offsets[:, 1, None] + torch.arange(w, device=x.device)  # (B, W)
    batch = torch.arange(b, device=x.device)[:, None, None, None]
    chans = torch.arange(c, device=x.device)[None, :, None, None]
    return padded[batch, chans, rows[:, None, :, None], cols[:, None, None, :]]


class _Seeded:
    """Run a function under a fixed RNG state when a seed (or generator) is given, else the global RNG."""

    @staticmethod
    def seed_from(seed: int | None, generator: torch.Generator | None) -> int | None:
        if seed is None and generator is not None:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        return seed

    @staticmethod
    def run(fn, device: torch.device, seed: int | None):
        if seed is None:
            return fn()
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=device.type if device.type != "cpu" else "cuda"):
            torch.manual_seed(int(seed) % (2**63 - 1))
            return fn()


class TrainTransform(nn.Module):
    """uint8 (B, C, H, W) on the training device -> augmented, normalised float (B, channels, h, w)."""

    def __init__(self, cfg: TransformConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("mean", torch.tensor(cfg.mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(cfg.std).view(1, -1, 1, 1), persistent=False)
        self.randaugment = None
        self.erasing = None
        if cfg.randaugment is not None:
            from kornia.augmentation.auto import RandAugment

            n, m = cfg.randaugment
            # kornia's magnitude scale is 0-30 (as the RandAugment paper's), open at both ends:
            # m = 0 (AugReg's "light1" randaug(2, 0)) becomes the smallest positive magnitude.
            self.randaugment = RandAugment(n=n, m=min(max(float(m), 1e-3), 30 - 1e-3))
        if cfg.random_erasing > 0:
            import kornia.augmentation as K

            self.erasing = K.RandomErasing(p=cfg.random_erasing, value=0.0)

    def forward(self, images: torch.Tensor, seed: int | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
        """Same (images, seed) -> same output; without seed/generator the global RNG is used."""
        seed = _Seeded.seed_from(seed, generator)
        return _Seeded.run(lambda: self._augment(images), images.device, seed)

    def _augment(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        x = match_channels(images, cfg.channels).float()
        b, _, h, w = x.shape
        if cfg.inception_crop:
            sampler = sample_tf_crop_boxes if cfg.crop_sampler == "tf" else sample_crop_boxes
            boxes = sampler(b, h, w, cfg.crop_scale, cfg.crop_ratio)
            x = crop_resize(x, boxes, cfg.image_size)
        else:
            x = resize_batch(x, cfg.image_size, cfg.interpolation)
        if cfg.random_shift > 0:
            x = random_shift(x, cfg.random_shift)
        if cfg.hflip:
            flip = (torch.rand(b) < 0.5).to(x.device).view(b, 1, 1, 1)
            x = torch.where(flip, x.flip(-1), x)
        x = x / 255.0
        if self.randaugment is not None:
            if x.shape[1] == 1:  # kornia's colour ops need 3 channels; on grey input they stay grey
                x = self.randaugment(x.expand(-1, 3, -1, -1)).mean(dim=1, keepdim=True).clamp(0.0, 1.0)
            else:
                x = self.randaugment(x).clamp(0.0, 1.0)
        x = (x - self.mean) / self.std
        if self.erasing is not None:
            x = self.erasing(x)
        return x


class EvalTransform(nn.Module):
    """uint8 (B, C, H, W) -> normalised float: resize + centre crop or plain resize (no randomness)."""

    def __init__(self, preprocess: Preprocess):
        super().__init__()
        self.preprocess = preprocess

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.preprocess.batch(images)


def build_train_transform(cfg: TransformConfig) -> TrainTransform:
    return TrainTransform(cfg)


def build_eval_transform(cfg: TransformConfig | Preprocess) -> EvalTransform:
    return EvalTransform(cfg if isinstance(cfg, Preprocess) else cfg.preprocess())


def one_hot(labels: torch.Tensor, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
    """Soft one-hot targets: 1 - smoothing + smoothing / K on the label, smoothing / K elsewhere."""
    off = smoothing / num_classes
    out = torch.full((len(labels), num_classes), off, device=labels.device)
    return out.scatter_(1, labels.view(-1, 1), 1.0 - smoothing + off)


def mix_batch(images: torch.Tensor, labels: torch.Tensor, num_classes: int, *, mixup_alpha: float = 0.0,
              cutmix_alpha: float = 0.0, prob: float = 1.0, switch_prob: float = 0.5,
              label_smoothing: float = 0.0, seed: int | None = None,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixup or cutmix over the whole batch, pairing each image with its neighbour (roll by 1, as big_vision).

    Mixup: lam ~ Beta(a, a), lam = max(lam, 1 - lam) (big_vision); x = lam x + (1 - lam) x_rolled.
    Cutmix: a box of area (1 - lam) from the rolled batch is pasted; lam = the area actually kept.
    Returns (images, soft targets (B, num_classes)); targets sum to 1 per row.
    """
    seed = _Seeded.seed_from(seed, generator)
    rng = np.random.default_rng(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))
    targets = one_hot(labels, num_classes, label_smoothing)
    if (mixup_alpha <= 0 and cutmix_alpha <= 0) or rng.random() >= prob or len(images) < 2:
        return images, targets
    use_cutmix = cutmix_alpha > 0 and (mixup_alpha <= 0 or rng.random() < switch_prob)
    other = images.roll(1, dims=0)
    other_t = targets.roll(1, dims=0)
    if use_cutmix:
        lam = float(rng.beta(cutmix_alpha, cutmix_alpha))
        h, w = images.shape[-2:]
        cut = math.sqrt(1.0 - lam)
        ch, cw = int(h * cut), int(w * cut)
        cy, cx = int(rng.integers(0, h)), int(rng.integers(0, w))
        y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2 + ch % 2, h)
        x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2 + cw % 2, w)
        mixed = images.clone()
        mixed[..., y0:y1, x0:x1] = other[..., y0:y1, x0:x1]
        lam = 1.0 - (y1 - y0) * (x1 - x0) / float(h * w)
    else:
        lam = float(rng.beta(mixup_alpha, mixup_alpha))
        lam = max(lam, 1.0 - lam)
        mixed = images * lam + other * (1.0 - lam)
    return mixed, targets * lam + other_t * (1.0 - lam)
