"""The one frozen dataclass that describes a model completely (ViT, hybrid or BiT ResNet)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from vitlab.errors import VitlabError

CLASSIFIERS = ("token", "gap", "map")
POSEMBS = ("learn", "sincos2d")
GELUS = ("tanh", "exact")
RESAMPLE_MODES = ("bilinear_ac", "bilinear", "bicubic", "bicubic_aa")


def _pair(value: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(value, int):
        return (value, value)
    if len(value) != 2:
        raise VitlabError(f"expected an int or a (height, width) pair, got {value!r}")
    return (int(value[0]), int(value[1]))


# The three ResNet families vitlab builds (see docs/models.md):
#  "bit-post": the ViT code's units (vit_jax/models_resnet.py): post-activation v1.5 bottleneck,
#              weight-standardised conv, GroupNorm; the hybrid stem. The default, so that configs
#              saved before `kind` existed keep their meaning.
#  "bit":      the released BiT (big_transfer): pre-activation bottleneck, weight-standardised conv,
#              GroupNorm, pre-head GroupNorm + ReLU.
#  "standard": torchvision / Hugging Face ResNet v1.5 with BatchNorm (basic or bottleneck blocks).
RESNET_KINDS = ("bit-post", "bit", "standard")
RESNET_BLOCKS = ("bottleneck", "basic")


@dataclass(frozen=True)
class ResNetConfig:
    """A ResNet body: the hybrid stem (kind "bit-post") or a ResNet classifier of any kind."""

    layers: tuple[int, ...] = (3, 4, 6, 3)
    width_factor: int = 1
    # Channels of the stem before the width factor (64 in every published ResNet); smaller values make
    # narrow ResNets for small-data studies. The first stage's inner width is `width`.
    base_width: int = 64
    # "bit": 7x7 stride-2 conv + 3x3 stride-2 max-pool (the ImageNet stem of every family);
    # "small": 3x3 stride-1 conv, no pool, for 28-32 px inputs.
    stem: str = "bit"
    kind: str = "bit-post"
    # "basic" (two 3x3 convolutions, expansion 1) exists for kind "standard" only (ResNet-18/34).
    block: str = "bottleneck"
    # Weight-standardisation epsilon; None: the kind's own (bit-post: (w-m)/(std+1e-5);
    # bit: (w-m)/sqrt(var+1e-10) as big_transfer, timm's files use 1e-8). Unused by "standard".
    ws_eps: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(n) for n in self.layers))
        if self.stem not in ("bit", "small"):
            raise VitlabError(f"ResNet stem must be 'bit' or 'small', got {self.stem!r}")
        if self.kind not in RESNET_KINDS:
            raise VitlabError(f"ResNet kind must be one of {RESNET_KINDS}, got {self.kind!r}")
        if self.block not in RESNET_BLOCKS:
            raise VitlabError(f"ResNet block must be one of {RESNET_BLOCKS}, got {self.block!r}")
        if self.block == "basic" and self.kind != "standard":
            raise VitlabError("basic blocks exist only for standard (BatchNorm) ResNets: use kind='standard'")
        if not isinstance(self.width_factor, int) or self.width_factor < 1:
            raise VitlabError(f"ResNet width_factor must be a positive integer, got {self.width_factor!r}")
        if not isinstance(self.base_width, int) or self.base_width < 1:
            raise VitlabError(f"ResNet base_width must be a positive integer, got {self.base_width!r}")
        if self.kind != "standard" and self.base_width % 32:
            raise VitlabError(f"GroupNorm ResNets use 32 groups: base_width must be a multiple of 32, got {self.base_width}")
        if any(n < 1 for n in self.layers):
            raise VitlabError(f"ResNet layers must be positive block counts, got {list(self.layers)}")

    @property
    def width(self) -> int:
        """Stem channels = inner width of the first stage."""
        return self.base_width * self.width_factor

    @property
    def expansion(self) -> int:
        """Output channels of a block per unit of its inner width (4 for bottlenecks, 1 for basic blocks)."""
        return 1 if self.block == "basic" else 4


@dataclass(frozen=True)
class ViTConfig:
    """Everything needed to build a model; saved as `config.json` in native checkpoints.

    `arch="vit"` is a (possibly hybrid) Vision Transformer; `arch="resnet"` a BiT ResNet classifier
    that uses `resnet`, `in_chans`, `num_classes` and `image_size` only.
    """

    image_size: tuple[int, int] = (224, 224)
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000
    dim: int = 768
    depth: int = 12
    heads: int = 12
    mlp_dim: int = 3072
    classifier: str = "token"
    representation_size: int | None = None
    posemb: str = "learn"
    dropout: float = 0.0
    attention_dropout: float = 0.0
    drop_path: float = 0.0
    layer_norm_eps: float = 1e-6
    gelu: str = "tanh"
    qkv_bias: bool = True
    head_bias_init: float = 0.0
    # How position embeddings are resampled when the grid changes; "bilinear_ac" is the official
    # scipy.ndimage.zoom(order=1), i.e. bilinear with align_corners=True.
    posemb_resample: str = "bilinear_ac"
    resnet: ResNetConfig | None = None
    # Channels of a convolutional stem used instead of `resnet` (Xiao et al. 2021, "Early convolutions
    # help transformers see better"): one 3x3 stride-2 convolution + GroupNorm + ReLU per entry, padded
    # so that any input size works (each halves a side, rounding up); empty: none.
    conv_stem: tuple[int, ...] = ()
    arch: str = "vit"
    name: str = "custom"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_size", _pair(self.image_size))
        if isinstance(self.resnet, dict):
            object.__setattr__(self, "resnet", ResNetConfig(**self.resnet))
        object.__setattr__(self, "conv_stem", tuple(int(c) for c in (self.conv_stem or ())))
        if self.arch == "vit" and self.resnet is not None and self.resnet.kind != "bit-post":
            raise VitlabError(f"a hybrid ViT's ResNet stem is the ViT code's (kind 'bit-post'), not {self.resnet.kind!r}")
        if self.conv_stem and (self.resnet is not None or self.arch != "vit"):
            raise VitlabError("conv_stem and resnet are two different stems: give one of them "
                              "(conv_stem=[] turns the conv stem off)")
        if any(c <= 0 for c in self.conv_stem):
            raise VitlabError(f"conv_stem channels must be positive, got {list(self.conv_stem)}")
        if self.arch not in ("vit", "resnet"):
            raise VitlabError(f"arch must be 'vit' or 'resnet', got {self.arch!r}")
        if self.arch == "resnet":
            if self.resnet is None:
                raise VitlabError("arch='resnet' needs a resnet=ResNetConfig(...)")
            return
        if self.classifier not in CLASSIFIERS:
            raise VitlabError(f"classifier must be one of {CLASSIFIERS}, got {self.classifier!r}")
        if self.posemb not in POSEMBS:
            raise VitlabError(f"posemb must be one of {POSEMBS}, got {self.posemb!r}")
        if self.gelu not in GELUS:
            raise VitlabError(f"gelu must be one of {GELUS}, got {self.gelu!r}")
        if self.posemb_resample not in RESAMPLE_MODES:
            raise VitlabError(f"posemb_resample must be one of {RESAMPLE_MODES}, got {self.posemb_resample!r}")
        if self.dim % self.heads:
            raise VitlabError(f"dim={self.dim} is not divisible by heads={self.heads}")
        self.grid_for(self.image_size)  # raises when the size does not fit the stride

    @property
    def is_hybrid(self) -> bool:
        """True when a CNN (BiT ResNet or conv stem) runs before the patch projection."""
        return self.resnet is not None or bool(self.conv_stem)

    @property
    def stride(self) -> int:
        """Pixels per token along each side (patch size times the stem's reduction)."""
        if self.conv_stem:
            return self.patch_size * 2 ** len(self.conv_stem)
        if self.resnet is None:
            return self.patch_size
        from vitlab.models.resnet import resnet_reduction

        return self.patch_size * resnet_reduction(self.resnet)

    def grid_for(self, size: int | tuple[int, int] | list[int]) -> tuple[int, int]:
        """The token grid (h, w) of an input of `size` pixels; VitlabError when the size does not fit.

        Plain ViTs and BiT hybrids need sides that are multiples of the stride. A conv stem pads, so
        it takes any size: its feature map is each side halved (rounded up) once per convolution, and
        only that map has to be a multiple of the patch size.
        """
        size = _pair(size)
        if not self.conv_stem:
            if size[0] % self.stride or size[1] % self.stride:
                raise VitlabError(
                    f"image size {size} is not a multiple of the total stride {self.stride}; "
                    f"use a size divisible by {self.stride}"
                )
            return (size[0] // self.stride, size[1] // self.stride)
        feature = list(size)
        for _ in self.conv_stem:
            feature = [-(-side // 2) for side in feature]
        if feature[0] % self.patch_size or feature[1] % self.patch_size:
            raise VitlabError(
                f"image size {size} gives a {feature[0]}x{feature[1]} conv-stem feature map, not a multiple "
                f"of the patch size {self.patch_size}; choose another image size or patch size"
            )
        return (feature[0] // self.patch_size, feature[1] // self.patch_size)

    @property
    def grid_size(self) -> tuple[int, int]:
        return self.grid_for(self.image_size)

    @property
    def num_prefix_tokens(self) -> int:
        return 1 if self.classifier == "token" else 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def replace(self, **changes: Any) -> ViTConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["image_size"] = list(self.image_size)
        if self.resnet is not None:
            out["resnet"]["layers"] = list(self.resnet.layers)
        out["conv_stem"] = list(self.conv_stem)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ViTConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise VitlabError(f"unknown model config fields {unknown}; known fields: {sorted(known)}")
        data = dict(data)
        if data.get("resnet") is not None and not isinstance(data["resnet"], ResNetConfig):
            data["resnet"] = ResNetConfig(**data["resnet"])
        return cls(**data)
