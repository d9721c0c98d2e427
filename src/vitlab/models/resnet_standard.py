"""Standard BatchNorm ResNets (torchvision / Hugging Face / timm `resnet*`, "v1.5"): kind "standard".

The stride of a bottleneck sits on its 3x3 convolution (v1.5, as torchvision, timm and HF's
`downsample_in_bottleneck=False`). State-dict keys are exactly torchvision's (`conv1`, `bn1`,
`layerS.B.convK|bnK|downsample.0|1`, `fc`), so torchvision and timm files load 1:1.
`base_width * width_factor` replaces the 64 of every published ResNet and scales all channels.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vitlab.models.config import ViTConfig
from vitlab.models.resnet import PooledClassifier, resnet_channels


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=1e-5, momentum=0.1)  # torchvision's defaults, spelled out


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions (the first carries the stride), add, ReLU (ResNet-18/34)."""

    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv3x3(cin, planes, stride)
        self.bn1 = _bn(planes)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = _bn(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + identity)


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (stride here: v1.5) -> 1x1 to 4x planes, add, ReLU (ResNet-26/50/101/152)."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        out = planes * self.expansion
        self.conv1 = _conv1x1(cin, planes)
        self.bn1 = _bn(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = _bn(planes)
        self.conv3 = _conv1x1(planes, out)
        self.bn3 = _bn(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + identity)


class StandardResNet(PooledClassifier, nn.Module):
    """torchvision-compatible ResNet classifier: stem, stages `layer1..N`, global average pool, `fc`."""

    _head_name = "fc"

    def __init__(self, config: ViTConfig):
        super().__init__()
        cfg = config.resnet
        assert cfg is not None and cfg.kind == "standard"
        self.config = config
        width = cfg.width
        block = BasicBlock if cfg.block == "basic" else Bottleneck
        if cfg.stem == "bit":  # torchvision's ImageNet stem: 7x7/2 conv, BN, ReLU, 3x3/2 max-pool
            self.conv1 = nn.Conv2d(config.in_chans, width, 7, stride=2, padding=3, bias=False)
            self.maxpool: nn.Module = nn.MaxPool2d(3, stride=2, padding=1)
        else:  # CIFAR-style stem for 28-32 px inputs: 3x3/1 conv, no pool
            self.conv1 = _conv3x3(config.in_chans, width)
            self.maxpool = nn.Identity()
        self.bn1 = _bn(width)
        self.relu = nn.ReLU(inplace=True)
        cin = width
        self.stage_names: list[str] = []
        for i, depth in enumerate(cfg.layers):
            planes, stride = width * 2**i, 1 if i == 0 else 2
            out = planes * block.expansion
            down = nn.Sequential(_conv1x1(cin, out, stride), _bn(out)) if (stride != 1 or cin != out) else None
            blocks = [block(cin, planes, stride, down)] + [block(out, planes) for _ in range(depth - 1)]
            name = f"layer{i + 1}"
            self.add_module(name, nn.Sequential(*blocks))
            self.stage_names.append(name)
            cin = out
        self.num_features = resnet_channels(cfg)
        self.fc: nn.Module = nn.Linear(self.num_features, config.num_classes) if config.num_classes > 0 else nn.Identity()
        # torchvision's init: kaiming-normal (fan_out, relu) convolutions, BN weight 1 / bias 0; the
        # Linear keeps PyTorch's default init, as in torchvision (timm and HF differ only in details).
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    @property
    def head(self) -> nn.Module:
        """The classifier under the name the other vitlab models use (stored as torchvision's `fc`)."""
        return self.fc

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The final feature map (B, C, h, w)."""
        self._check_images(x)
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for name in self.stage_names:
            x = getattr(self, name)(x)
        return x

    def _install_head(self, head: nn.Module) -> None:
        self.fc = head

    _stem_feature_module = "relu"  # timm's `act1`: the stem's ReLU, before the max-pool

    def _stage_modules(self) -> list[nn.Module]:
        return [getattr(self, name) for name in self.stage_names]

    def _stem_with_feature(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feature = self.relu(self.bn1(self.conv1(x)))
        return self.maxpool(feature), feature

    def _keep_stages(self, count: int) -> None:
        for name in self.stage_names[count:]:
            delattr(self, name)
        self.stage_names = self.stage_names[:count]

    def _drop_stem_pool(self) -> None:
        self.maxpool = nn.Identity()

    def _stage_module_name(self, index: int) -> str:
        return f"layer{index + 1}"
