"""BiT ResNet as in the official ViT code (`vit_jax/models_resnet.py`): the hybrid stem and the baselines.

Weight-standardised convolutions ((w - mean) / (std + 1e-5); `ResNetConfig.ws_eps` sets another eps, e.g.
timm's 1e-8 for its hybrid files), GroupNorm (32 groups, eps 1e-6),
post-activation bottleneck units with the stride on the 3x3 convolution, TF-style 'SAME' padding,
and the last GroupNorm scale of each unit initialised to zero. Key names follow timm's ResNetV2.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from vitlab.errors import VitlabError
from vitlab.models.config import ResNetConfig, ViTConfig
from vitlab.models.surface import TimmSurface, check_output_fmt, feature_take_indices, update_preprocess_size

# The official StdConv's epsilon (vit_jax/models_resnet.py: w / (std + 1e-5)); `ResNetConfig.ws_eps` overrides it.
OFFICIAL_WS_EPS = 1e-5


def post_ws_eps(cfg: ResNetConfig) -> float:
    """The weight-standardisation epsilon of a post-activation (kind "bit-post") body: its own, else the official."""
    return OFFICIAL_WS_EPS if cfg.ws_eps is None else float(cfg.ws_eps)


def resnet_reduction(cfg: ResNetConfig) -> int:
    """Total downscaling of the body: the stem, then a factor 2 for every stage after the first."""
    stem = 4 if cfg.stem == "bit" else 1
    return stem * 2 ** max(len(cfg.layers) - 1, 0)


def resnet_channels(cfg: ResNetConfig) -> int:
    """Channels of the body's output feature map."""
    width = cfg.width
    if not cfg.layers:
        return width
    return width * 2 ** (len(cfg.layers) - 1) * cfg.expansion


def _same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TF 'SAME' padding (before, after) for one spatial axis: the extra pixel goes after."""
    out = math.ceil(size / stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def _pad_same(x: torch.Tensor, kernel: int, stride: int, value: float = 0.0) -> torch.Tensor:
    top, bottom = _same_padding(x.shape[-2], kernel, stride)
    left, right = _same_padding(x.shape[-1], kernel, stride)
    if top == bottom == left == right == 0:
        return x
    return F.pad(x, (left, right, top, bottom), value=value)


class StdConv2dSame(nn.Conv2d):
    """Weight-standardised convolution with TF 'SAME' padding, exactly as the official StdConv."""

    def __init__(self, in_chans: int, out_chans: int, kernel_size: int, stride: int = 1, eps: float = OFFICIAL_WS_EPS):
        super().__init__(in_chans, out_chans, kernel_size, stride=stride, padding=0, bias=False)
        self.eps = eps

    def standardized_weight(self) -> torch.Tensor:
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        std = w.std(dim=(1, 2, 3), keepdim=True, unbiased=False)
        return (w - mean) / (std + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _pad_same(x, self.kernel_size[0], self.stride[0])
        return F.conv2d(x, self.standardized_weight(), None, self.stride)


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6)


class Downsample(nn.Module):
    """The projection branch (`conv_proj` + `gn_proj`)."""

    def __init__(self, in_chans: int, out_chans: int, stride: int, eps: float = OFFICIAL_WS_EPS):
        super().__init__()
        self.conv = StdConv2dSame(in_chans, out_chans, 1, stride, eps)
        self.norm = _group_norm(out_chans)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class Bottleneck(nn.Module):
    """Post-activation bottleneck unit (`ResidualUnit` of the official code)."""

    def __init__(self, in_chans: int, features: int, stride: int, eps: float = OFFICIAL_WS_EPS):
        super().__init__()
        out_chans = features * 4
        self.downsample = Downsample(in_chans, out_chans, stride, eps) if (in_chans != out_chans or stride != 1) else None
        self.conv1 = StdConv2dSame(in_chans, features, 1, eps=eps)
        self.norm1 = _group_norm(features)
        self.conv2 = StdConv2dSame(features, features, 3, stride, eps)
        self.norm2 = _group_norm(features)
        self.conv3 = StdConv2dSame(features, out_chans, 1, eps=eps)
        self.norm3 = _group_norm(out_chans)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.norm1(self.conv1(x)))
        y = F.relu(self.norm2(self.conv2(y)))
        y = self.norm3(self.conv3(y))
        return F.relu(residual + y)


class Stage(nn.Module):
    def __init__(self, in_chans: int, features: int, depth: int, first_stride: int, eps: float = OFFICIAL_WS_EPS):
        super().__init__()
        self.blocks = nn.Sequential(
            *[Bottleneck(in_chans if i == 0 else features * 4, features, first_stride if i == 0 else 1, eps)
              for i in range(depth)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class Stem(nn.Module):
    """'bit': conv_root 7x7/2 + gn_root + ReLU + 3x3/2 'SAME' max-pool. 'small': 3x3/1 conv + GN + ReLU."""

    def __init__(self, in_chans: int, width: int, kind: str = "bit", eps: float = OFFICIAL_WS_EPS):
        super().__init__()
        self.kind = kind
        self.pools = kind == "bit"  # False after prune_intermediate_layers keeps the stem's feature alone
        self.conv = StdConv2dSame(in_chans, width, 7 if kind == "bit" else 3, 2 if kind == "bit" else 1, eps)
        self.norm = _group_norm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.conv(x)))
        if self.pools:
            x = F.max_pool2d(_pad_same(x, 3, 2, value=float("-inf")), 3, 2)
        return x

    def forward_with_feature(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the stem's output, its feature before the pool): timm's stem feature of a post-activation ResNetV2."""
        feature = F.relu(self.norm(self.conv(x)))
        if not self.pools:
            return feature, feature
        return F.max_pool2d(_pad_same(feature, 3, 2, value=float("-inf")), 3, 2), feature


class ResNetBody(nn.Module):
    """Stem + stages; returns the final feature map (B, C, H/r, W/r)."""

    def __init__(self, cfg: ResNetConfig, in_chans: int = 3):
        super().__init__()
        width = cfg.width
        # every StdConv takes the config's eps: before, ws_eps was stored and exported but the body kept 1e-5
        eps = post_ws_eps(cfg)
        self.stem = Stem(in_chans, width, cfg.stem, eps)
        stages, chans = [], width
        for i, depth in enumerate(cfg.layers):
            stages.append(Stage(chans, width * 2**i, depth, 1 if i == 0 else 2, eps))
            chans = width * 2**i * 4
        self.stages = nn.Sequential(*stages)
        self.out_channels = resnet_channels(cfg)
        self.reduction = resnet_reduction(cfg)
        init_resnet_(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))


def lecun_normal_(weight: torch.Tensor) -> torch.Tensor:
    """flax's default kernel init: truncated normal with variance 1/fan_in."""
    fan_in = weight[0].numel()
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978
    return nn.init.trunc_normal_(weight, std=std, a=-2 * std, b=2 * std)


def init_conv_gn_(module: nn.Module) -> None:
    """flax defaults: lecun-normal convolutions, GroupNorm scale ones and bias zeros."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            lecun_normal_(m.weight)
        elif isinstance(m, nn.GroupNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def init_resnet_(module: nn.Module) -> None:
    """Official init: `init_conv_gn_`, then a zero scale on each unit's last GroupNorm."""
    init_conv_gn_(module)
    for m in module.modules():
        if isinstance(m, Bottleneck):
            nn.init.zeros_(m.norm3.weight)


def zero_head(num_features: int, num_classes: int, like: torch.Tensor | None = None) -> nn.Module:
    """A zero-initialised linear classifier (paper B.1.1, BiT's fine-tuning rule); 0 classes: no head."""
    if num_classes <= 0:
        return nn.Identity()
    head = nn.Linear(num_features, num_classes)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head if like is None else head.to(device=like.device, dtype=like.dtype)


class PooledClassifier(TimmSurface):
    """What the three ResNet families share: global average pooling, a linear head, any input size.

    A class sets `config`, `num_features` and its head, and implements `forward_features` and
    `_install_head` (where the head lives: `head`, or torchvision's `fc`)."""

    @property
    def num_classes(self) -> int:
        """The head's outputs (timm's attribute; 0: no head)."""
        return self.config.num_classes

    def get_classifier(self) -> nn.Module:
        """The classifier layer, as timm's `get_classifier()`."""
        return self.head

    grad_checkpointing = False

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in the backward pass to save memory (timm's call), for the GroupNorm
        ResNets. A standard ResNet refuses: the recomputation would run its BatchNorm layers a second time and
        update their running statistics twice per step."""
        if enable and self.config.resnet.kind == "standard":
            raise VitlabError(f"{self.config.name}: activation checkpointing would update BatchNorm's running "
                              "statistics twice per step (the backward runs the forward again); train it without "
                              "(drop --grad-checkpointing) or use a GroupNorm ResNet (bit-rNxW)")
        self.grad_checkpointing = enable

    def _run_stages(self, x: torch.Tensor) -> torch.Tensor:
        """Every stage on x (`_run_stage`: block by block under activation checkpointing when it is on)."""
        for stage in self._stage_modules():
            x = self._run_stage(stage, x)
        return x

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        pooled = features.mean(dim=(2, 3))  # = AdaptiveAvgPool2d(1) + flatten
        return pooled if pre_logits else self.head(pooled)

    def forward(self, x: torch.Tensor, return_attention: bool = False) -> torch.Tensor:
        if return_attention:  # the ViT's keyword: say why it has no answer here instead of Python's TypeError
            raise VitlabError(f"{self.config.name} is a convolutional network and has no attention maps; "
                              "return_attention=True is for ViT and hybrid models")
        return self.forward_head(self.forward_features(x))

    def set_image_size(self, image_size: int | tuple[int, int]) -> None:
        """Record a new input size; convolutions and global pooling take any size."""
        new_config = self.config.replace(image_size=image_size)
        self.preprocess = update_preprocess_size(self.preprocess, self.config.image_size, new_config.image_size)
        self.config = new_config

    def reset_classifier(self, num_classes: int, global_pool: str | None = None, *,
                         keep_representation: bool = False) -> None:
        """Replace the head by a zero-initialised one with `num_classes` outputs (paper B.1.1).

        `global_pool` is timm's second argument: a ResNet here always averages ('avg'; anything else is
        refused). `keep_representation` is accepted for symmetry with the ViT; a ResNet has no such layer."""
        self._check_global_pool(global_pool)
        self._install_head(zero_head(self.num_features, num_classes, like=next(self.parameters())))
        self.config = self.config.replace(num_classes=num_classes)
        self._forget_classes()

    def _install_head(self, head: nn.Module) -> None:
        self.head = head

    # -------------------------------------------------------------------- intermediate features
    # timm's feature list of a ResNet: the stem's output before its pool (index 0), then every stage's.
    _stem_feature_module = "stem.norm"  # timm's name of the stem's feature (a ReLU follows the norm here)
    output_formats = ("NCHW",)  # feature maps only (timm's ResNets likewise)

    def _stage_modules(self) -> list[nn.Module]:
        return list(self.stages)

    def _stem_with_feature(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.stem.forward_with_feature(x)

    def _head_norm(self, x: torch.Tensor) -> torch.Tensor:
        """What follows the last stage before pooling (the pre-activation BiT's GroupNorm + ReLU); none here."""
        return x

    def _run_stage(self, stage: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One stage, block by block under activation checkpointing when it is on and gradients flow."""
        if not (self.grad_checkpointing and self.training and torch.is_grad_enabled()):
            return stage(x)
        for block in getattr(stage, "blocks", stage):
            x = checkpoint(block, x, use_reentrant=False)
        return x

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None, norm: bool = False,
                              stop_early: bool = False, output_fmt: str = "NCHW", intermediates_only: bool = False):
        """timm's `forward_intermediates` of a ResNet: feature maps of the stem (index 0, before its pool) and of
        each stage (1..S) in `indices` (None: all; n: the last n; a list, negative from the end); `norm` puts the
        last stage's through the pre-head norm where there is one. Returns (forward_features(x), maps) or the maps."""
        check_output_fmt(output_fmt, self.output_formats)
        stages = self._stage_modules()
        take, last = feature_take_indices(1 + len(stages), indices)
        self._check_images(x)
        x, stem_feature = self._stem_with_feature(x)
        taken = [stem_feature] if 0 in take else []
        index = 0
        for index, stage in enumerate(stages[:last] if stop_early else stages, start=1):
            x = self._run_stage(stage, x)
            if index in take:
                taken.append(self._head_norm(x) if norm and index == len(stages) else x)
        if intermediates_only:
            return taken
        return (self._head_norm(x) if index == len(stages) else x), taken

    def prune_intermediate_layers(self, indices: int | list[int] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """timm's: drop the stages after the last of `indices` (the config's layers follow), the stem's pool when
        only the stem's feature is kept, the pre-head norm with `prune_norm` or when the last stage goes, and the
        head with `prune_head` or when the last stage goes (it was sized for it); returns the indices kept."""
        stages = self._stage_modules()
        take, last = feature_take_indices(1 + len(stages), indices)
        prune_end = last < len(stages)
        channels = self.feature_info[last]["num_chs"]
        self._keep_stages(last)
        resnet = self.config.resnet
        self.config = self.config.replace(resnet=dataclasses.replace(resnet, layers=resnet.layers[:last]))
        if prune_norm or prune_end:
            self._drop_head_norm()
        if last == 0:
            self._drop_stem_pool()
        if prune_end:
            self.num_features = channels
        if prune_head or prune_end:
            self.reset_classifier(0)
        return take

    def _keep_stages(self, count: int) -> None:
        self.stages = self.stages[:count]

    def _drop_head_norm(self) -> None:
        """No pre-head norm here (the BiT ResNet overrides)."""

    def _drop_stem_pool(self) -> None:
        self.stem.pools = False

    @property
    def feature_info(self) -> list[dict]:
        """timm's `feature_info`: the stem's feature and each stage's (module, channels, pixels per position)."""
        cfg = self.config.resnet
        stem_stride = 2 if cfg.stem == "bit" else 1  # the 7x7/2 convolution; its 3x3/2 pool halves once more
        info = [{"module": self._stem_feature_module, "num_chs": cfg.width, "reduction": stem_stride}]
        for i in range(len(self._stage_modules())):
            info.append({"module": self._stage_module_name(i), "num_chs": cfg.width * 2**i * cfg.expansion,
                         "reduction": stem_stride**2 * 2**i})
        return info

    def _stage_module_name(self, index: int) -> str:
        return f"stages.{index}"


class ResNet(PooledClassifier, nn.Module):
    """The ViT code's ResNet as a classifier (kind "bit-post"): body, global average pool, linear head."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        assert config.resnet is not None
        self.config = config
        body = ResNetBody(config.resnet, config.in_chans)
        self.stem, self.stages = body.stem, body.stages
        self.num_features = body.out_channels
        self.head = zero_head(self.num_features, config.num_classes)
        if isinstance(self.head, nn.Linear):
            nn.init.constant_(self.head.bias, config.head_bias_init)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The final feature map (B, C, h, w)."""
        self._check_images(x)
        return self._run_stages(self.stem(x))
