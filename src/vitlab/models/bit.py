"""The BiT ResNets as released (google-research/big_transfer, `bit_pytorch/models.py::ResNetV2`).

Pre-activation bottleneck units (GroupNorm + ReLU before each convolution, no ReLU after the add),
weight-standardised convolutions ((w - mean) / sqrt(var + eps), biased variance), GroupNorm with
32 groups and eps 1e-5, symmetric fixed padding, a pre-head GroupNorm + ReLU, global average pool
and a linear head. This differs from `models/resnet.py`, which is the ViT code's post-activation
variant (kind "bit-post"); this module is kind "bit". Key names follow timm's `resnetv2_*_bit`
(`stem.conv`, `stages.S.blocks.B.*`, `norm`, `head`), except that `head` is an `nn.Linear` where
timm stores a 1x1 convolution `head.fc` (the timm reader/writer reshapes).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.errors import VitlabError
from vitlab.models.config import ResNetConfig, ViTConfig
from vitlab.models.resnet import PooledClassifier, init_conv_gn_, zero_head

# big_transfer's weight-standardisation epsilon (bit_pytorch, bit_jax, bit_tf2 all use 1e-10);
# timm's BiT models use 1e-8, which their readers set through ResNetConfig.ws_eps.
BIT_WS_EPS = 1e-10
GN_EPS = 1e-5


class StdConv2d(nn.Conv2d):
    """Weight-standardised convolution, symmetric padding, no bias (bit_pytorch's StdConv2d)."""

    def __init__(self, in_chans: int, out_chans: int, kernel_size: int, stride: int = 1, padding: int = 0,
                 eps: float = BIT_WS_EPS):
        super().__init__(in_chans, out_chans, kernel_size, stride=stride, padding=padding, bias=False)
        self.eps = eps

    def standardized_weight(self) -> torch.Tensor:
        var, mean = torch.var_mean(self.weight, dim=(1, 2, 3), keepdim=True, unbiased=False)
        return (self.weight - mean) / torch.sqrt(var + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.standardized_weight(), None, self.stride, self.padding)


def _gn(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=GN_EPS)


class Downsample(nn.Module):
    """The projection shortcut: a strided 1x1 StdConv of the pre-activated input, no norm."""

    def __init__(self, in_chans: int, out_chans: int, stride: int, eps: float):
        super().__init__()
        self.conv = StdConv2d(in_chans, out_chans, 1, stride, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class PreActBottleneck(nn.Module):
    """GN+ReLU -> (shortcut) -> 1x1 -> GN+ReLU -> 3x3 (stride) -> GN+ReLU -> 1x1, plus the shortcut."""

    def __init__(self, in_chans: int, out_chans: int, mid_chans: int, stride: int, eps: float):
        super().__init__()
        self.downsample = (Downsample(in_chans, out_chans, stride, eps)
                           if stride != 1 or in_chans != out_chans else None)
        self.norm1 = _gn(in_chans)
        self.conv1 = StdConv2d(in_chans, mid_chans, 1, eps=eps)
        self.norm2 = _gn(mid_chans)
        # The stride sits on the 3x3 conv, as big_transfer ("Original code has it on conv1!!").
        self.conv2 = StdConv2d(mid_chans, mid_chans, 3, stride, padding=1, eps=eps)
        self.norm3 = _gn(mid_chans)
        self.conv3 = StdConv2d(mid_chans, out_chans, 1, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = F.relu(self.norm1(x))
        # The projection takes the pre-activated input; the identity shortcut takes the raw input.
        shortcut = x if self.downsample is None else self.downsample(pre)
        y = self.conv1(pre)
        y = self.conv2(F.relu(self.norm2(y)))
        y = self.conv3(F.relu(self.norm3(y)))
        return y + shortcut


class Stage(nn.Module):
    def __init__(self, in_chans: int, mid_chans: int, depth: int, stride: int, eps: float):
        super().__init__()
        out_chans = 4 * mid_chans
        self.blocks = nn.Sequential(*[
            PreActBottleneck(in_chans if i == 0 else out_chans, out_chans, mid_chans, stride if i == 0 else 1, eps)
            for i in range(depth)
        ])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class Stem(nn.Module):
    """'bit': StdConv 7x7/2 (padding 3) -> zero pad 1 -> max-pool 3x3/2; 'small': StdConv 3x3/1, no pool.

    No norm or activation: in a pre-activation net the first unit's `norm1` does that. The pool pads
    with zeros explicitly because its input can be negative, where MaxPool2d(padding=1) would pad
    with -inf and give different border values (bit_pytorch: "subtly not the same").
    """

    def __init__(self, in_chans: int, width: int, kind: str, eps: float):
        super().__init__()
        if kind == "bit":
            self.conv = StdConv2d(in_chans, width, 7, stride=2, padding=3, eps=eps)
            self.pad = nn.ConstantPad2d(1, 0.0)
            self.pool = nn.MaxPool2d(kernel_size=3, stride=2, padding=0)
        else:
            self.conv = StdConv2d(in_chans, width, 3, stride=1, padding=1, eps=eps)
            self.pad = nn.Identity()
            self.pool = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.pad(self.conv(x)))

    def forward_with_feature(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the stem's output, its feature): the convolution's output before the pool, timm's stem feature."""
        feature = self.conv(x)
        return self.pool(self.pad(feature)), feature


def bit_ws_eps(cfg: ResNetConfig) -> float:
    """The weight-standardisation epsilon of a kind-"bit" config: its own, else big_transfer's 1e-10."""
    return BIT_WS_EPS if cfg.ws_eps is None else float(cfg.ws_eps)


class BiTResNet(PooledClassifier, nn.Module):
    """The released BiT ResNet-v2 classifier (BiT-S / BiT-M R50x1 ... R152x4)."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        cfg = config.resnet
        if cfg is None or cfg.kind != "bit":
            raise VitlabError("BiTResNet needs resnet=ResNetConfig(kind='bit', ...); "
                              f"got {None if cfg is None else cfg.kind!r}")
        self.config = config
        eps = bit_ws_eps(cfg)
        width = cfg.width
        self.stem = Stem(config.in_chans, width, cfg.stem, eps)
        stages, chans = [], width
        for i, depth in enumerate(cfg.layers):
            mid = width * 2**i
            stages.append(Stage(chans, mid, depth, 1 if i == 0 else 2, eps))
            chans = 4 * mid
        self.stages = nn.Sequential(*stages)
        self.num_features = chans
        self.norm = _gn(chans)  # the pre-head GroupNorm (+ ReLU in forward_features)
        init_conv_gn_(self)
        self.head = zero_head(self.num_features, config.num_classes)  # BiT's fine-tuning rule, also at build

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The final feature map (B, C, h, w), after the pre-head GroupNorm and ReLU."""
        self._check_images(x)
        return self._head_norm(self._run_stages(self.stem(x)))

    _stem_feature_module = "stem.conv"  # pre-activation: the stem has no norm, its feature is the convolution's

    def _head_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The pre-head GroupNorm + ReLU (timm's GroupNormAct `norm`); gone after `prune_intermediate_layers`."""
        if isinstance(self.norm, nn.Identity):  # pruned, as timm's GroupNormAct: its ReLU went with it
            return x
        return F.relu(self.norm(x))

    def _drop_head_norm(self) -> None:
        self.norm = nn.Identity()

    def _drop_stem_pool(self) -> None:
        self.stem.pad, self.stem.pool = nn.Identity(), nn.Identity()
