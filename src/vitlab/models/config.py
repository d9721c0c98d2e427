"""The one frozen dataclass that describes a model completely (ViT, hybrid or BiT ResNet)."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from vitlab.errors import VitlabError
from vitlab.limits import (
    MAX_CONV_STEM,
    MAX_DEPTH,
    MAX_IMAGE_SIZE,
    MAX_IN_CHANS,
    MAX_MLP_DIM,
    MAX_NUM_CLASSES,
    MAX_RESNET_CHANNELS,
    MAX_RESNET_STAGES,
    MAX_STAGE_BLOCKS,
    MAX_WIDTH,
    check_float,
    check_int,
    check_size_pair,
    is_number,
)

CLASSIFIERS = ("token", "gap", "map")
POSEMBS = ("learn", "sincos2d")
GELUS = ("tanh", "exact")
# "bicubic_ac" (align_corners=True) is torchvision's `interpolate_embeddings`; see posemb.resample_grid.
RESAMPLE_MODES = ("bilinear_ac", "bilinear", "bicubic", "bicubic_aa", "bicubic_ac")


def _pair(value: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    """An input size as (h, w); not bounded, since inputs at run time may be any size."""
    if is_number(value):
        return (int(value), int(value))
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise VitlabError(f"expected an int or a (height, width) pair, got {value!r}")
    return (int(value[0]), int(value[1]))


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # the dataclasses are frozen; __post_init__ normalises fields


# Other libraries' names for config fields (Hugging Face's, timm's keyword arguments) with the same meaning:
# `create_model` and `get_config` take either spelling, e.g. create_model("vit_base_patch16_224", img_size=384,
# drop_path_rate=0.1) (timm's drop_path_rate rises linearly over the blocks from 0, as vitlab's drop_path does).
# Hugging Face's ViTConfig: hidden_size, num_hidden_layers, num_attention_heads; torchvision's VisionTransformer:
# num_layers, num_heads, hidden_dim; timm's: embed_dim, depth, num_heads, img_size.
FIELD_ALIASES = {"num_layers": "depth", "num_hidden_layers": "depth", "hidden_size": "dim", "hidden_dim": "dim",
                 "num_heads": "heads", "num_attention_heads": "heads", "width": "dim",
                 "patch": "patch_size", "img_size": "image_size", "embed_dim": "dim", "drop_path_rate": "drop_path",
                 "attn_drop_rate": "attention_dropout"}


def canonical_fields(overrides: dict[str, Any]) -> dict[str, Any]:
    """`overrides` under vitlab's field names (`FIELD_ALIASES`); two spellings of one field are refused."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        field = FIELD_ALIASES.get(key, key)
        if field in out:
            given = [k for k in overrides if FIELD_ALIASES.get(k, k) == field]
            raise VitlabError(f"{' and '.join(given)} name the same setting ({field}): give it once")
        out[field] = value
    return out


# Their names for settings that do not map one to one: what to write instead.
_FOREIGN_FIELDS = {
    "mlp_ratio": "mlp_dim (the MLP's width itself: mlp_ratio x dim)",
    "intermediate_size": "mlp_dim",
    "drop_rate": "dropout (the official dropout: after the position embeddings and in the MLP)",
    "hidden_dropout_prob": "dropout",
    "attention_probs_dropout_prob": "attention_dropout",
    "global_pool": "classifier ('token' or 'gap')",
    "class_token": "classifier ('token' or 'gap')",
    "layer_norm_epsilon": "layer_norm_eps",
    "num_channels": "in_chans",
    "num_labels": "num_classes",
    "hidden_act": "gelu ('exact' for Hugging Face's \"gelu\", 'tanh' for \"gelu_pytorch_tanh\" and \"gelu_new\")",
    "act_layer": "gelu ('exact' is timm's nn.GELU, 'tanh' the official ViT's)",
    # timm's create_model options with no vitlab setting: what does the same here
    "dynamic_img_size": "no setting: a vitlab ViT takes any multiple of its stride at run time (the position "
                        "embeddings are resampled per call)",
    "checkpoint_path": "pretrained='PATH' (or vitlab.load(PATH))",
    "features_only": "vitlab.create_model(name, features_only=True, out_indices=...) (a feature extractor around "
                     "the model, not a config field)",
    "init_values": "no setting: the paper's ViT has no LayerScale",
    "exportable": "no setting: `vitlab export` and torch.onnx export the fused attention as it is",
}


def size_to_run_at(image_size: Any, overrides: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(image_size, the other overrides) where `image_size` may come as timm's `img_size` keyword: the size to
    build or run the model at (`create_model`, `vitlab.load`), the two spellings refused together."""
    if "img_size" not in overrides:
        return image_size, overrides
    if image_size is not None:
        raise VitlabError("image_size and img_size name the same setting: give it once")
    rest = dict(overrides)
    return rest.pop("img_size"), rest


def check_fields(cls: type, names: Any, what: str = "model config") -> None:
    """`names` must be fields of the config dataclass `cls`: one line naming the unknown ones (not a TypeError)."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(names) - known)
    if unknown:
        raise unknown_fields_error(unknown, known, what)


def unknown_fields_error(unknown: list[str], known: set[str], what: str = "model config") -> VitlabError:
    """One line naming the unknown fields, what to write instead where it is known (another library's name, a
    near spelling), and the known fields."""
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
        instead = FIELD_ALIASES.get(name) or _FOREIGN_FIELDS.get(name) or (close[0] if close else None)
        if instead:
            hints.append(f"for {name} use {instead}")
    hint = f" ({'; '.join(hints)})" if hints else ""
    return VitlabError(f"unknown {what} fields {unknown}{hint}; known fields: {sorted(known)}")


def _from_dict(cls: type, data: Any, what: str) -> Any:
    """Build a config dataclass from a dict, naming unknown fields in one line."""
    if not isinstance(data, dict):
        raise VitlabError(f"{what} must be a mapping of fields, got {type(data).__name__}")
    check_fields(cls, data, what)
    return cls(**data)


# The three ResNet families vitlab builds (see docs/models.md):
#  "bit-post": the ViT code's units (vit_jax/models_resnet.py): post-activation v1.5 bottleneck,
#              weight-standardised conv, GroupNorm; the hybrid stem. The default, so that configs
#              saved before `kind` existed keep their meaning.
#  "bit":      the released BiT (big_transfer): pre-activation bottleneck, weight-standardised conv,
#              GroupNorm, pre-head GroupNorm + ReLU.
#  "standard": torchvision / Hugging Face ResNet v1.5 with BatchNorm (basic or bottleneck blocks).
RESNET_KINDS = ("bit-post", "bit", "standard")
RESNET_BLOCKS = ("bottleneck", "basic")


def _width_factor(value: Any) -> int | float:
    """A positive width factor; integral values become ints so that 1.0 and 1 are the same config."""
    factor = check_float("ResNet width_factor", value, 0.0, float(MAX_WIDTH), include_low=False)
    return int(factor) if factor.is_integer() else factor


@dataclass(frozen=True)
class ResNetConfig:
    """A ResNet body: the hybrid stem (kind "bit-post") or a ResNet classifier of any kind."""

    layers: tuple[int, ...] = (3, 4, 6, 3)
    # A float is allowed: the official code's root width is int(64 * width_factor) (models_vit.py).
    width_factor: int | float = 1
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
        if not isinstance(self.layers, (list, tuple)) or len(self.layers) > MAX_RESNET_STAGES:
            raise VitlabError(f"ResNet layers must be a list of at most {MAX_RESNET_STAGES} block counts, "
                              f"got {self.layers!r}")
        _set(self, "layers", tuple(check_int("ResNet layers (blocks per stage)", n, 1, MAX_STAGE_BLOCKS)
                                   for n in self.layers))
        if self.stem not in ("bit", "small"):
            raise VitlabError(f"ResNet stem must be 'bit' or 'small', got {self.stem!r}")
        if self.kind not in RESNET_KINDS:
            raise VitlabError(f"ResNet kind must be one of {RESNET_KINDS}, got {self.kind!r}")
        if self.block not in RESNET_BLOCKS:
            raise VitlabError(f"ResNet block must be one of {RESNET_BLOCKS}, got {self.block!r}")
        if self.block == "basic" and self.kind != "standard":
            raise VitlabError("basic blocks exist only for standard (BatchNorm) ResNets: use kind='standard'")
        _set(self, "width_factor", _width_factor(self.width_factor))
        _set(self, "base_width", check_int("ResNet base_width", self.base_width, 1, MAX_WIDTH))
        if self.ws_eps is not None:
            _set(self, "ws_eps", check_float("ResNet ws_eps", self.ws_eps, 0.0, 1.0, include_low=False))
        self._check_widths()

    def _check_widths(self) -> None:
        width = self.width
        if not 1 <= width <= MAX_WIDTH:
            raise VitlabError(f"ResNet stem width int({self.base_width} * {self.width_factor}) = {width} must be from "
                              f"1 to {MAX_WIDTH}; choose another width_factor or base_width")
        if self.kind != "standard" and width % 32:
            raise VitlabError(f"GroupNorm ResNets use 32 groups: the stem width int({self.base_width} * "
                              f"{self.width_factor}) = {width} must be a multiple of 32; choose another "
                              "width_factor or base_width")
        last = width * 2 ** max(len(self.layers) - 1, 0) * self.expansion
        if last > MAX_RESNET_CHANNELS:
            raise VitlabError(f"this ResNet's last stage would have {last} channels, above {MAX_RESNET_CHANNELS}; "
                              "use fewer stages or a smaller width")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ResNetConfig:
        return _from_dict(cls, data, "ResNet config")

    @property
    def width(self) -> int:
        """Stem channels = inner width of the first stage; stage i is `width * 2**i` wide (official rule)."""
        return int(self.base_width * self.width_factor)

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
        self._check_sizes()
        self._check_regularisation()
        self._check_stems()
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
        self.grid_for(self.image_size)  # raises when the size does not fit the stride

    def _check_sizes(self) -> None:
        """Typed, bounded sizes (limits.py), so that no config can ask for an absurd model."""
        _set(self, "image_size", check_size_pair("image_size", self.image_size, MAX_IMAGE_SIZE))
        _set(self, "patch_size", check_int("patch_size", self.patch_size, 1, MAX_IMAGE_SIZE))
        _set(self, "in_chans", check_int("in_chans", self.in_chans, 1, MAX_IN_CHANS))
        _set(self, "num_classes", check_int("num_classes (0: no head)", self.num_classes, 0, MAX_NUM_CLASSES))
        _set(self, "dim", check_int("dim (width)", self.dim, 1, MAX_WIDTH))
        _set(self, "depth", check_int("depth", self.depth, 1, MAX_DEPTH))
        _set(self, "heads", check_int("heads", self.heads, 1, self.dim))
        if self.dim % self.heads:
            # the most heads, up to 16, that keep a head at least 16 wide (Ti/S/B keep 64)
            divisors = [h for h in range(1, 17) if self.dim % h == 0 and self.dim // h >= 16] or [1]
            # where the 12 heads are likely ViT-B's, left unchanged by a custom(dim=...): say where they came from
            # (not otherwise: `vitlab train`'s custom starts from the small-data ViT's 4 heads)
            origin = (" (a model not named by its size, such as custom, starts from ViT-B's 12 heads)"
                      if self.heads == 12 else "")
            raise VitlabError(f"dim={self.dim} is not divisible by heads={self.heads}; choose heads that divide the "
                              f"width, e.g. heads={divisors[-1]}{origin}")
        _set(self, "mlp_dim", check_int("mlp_dim", self.mlp_dim, 1, MAX_MLP_DIM))
        if self.representation_size is not None:
            _set(self, "representation_size",
                 check_int("representation_size (None: no layer)", self.representation_size, 0, MAX_WIDTH))

    def _check_regularisation(self) -> None:
        for name in ("dropout", "attention_dropout", "drop_path"):
            _set(self, name, check_float(name, getattr(self, name), 0.0, 1.0, include_high=False))
        _set(self, "layer_norm_eps", check_float("layer_norm_eps", self.layer_norm_eps, 0.0, 1.0, include_low=False))
        _set(self, "head_bias_init", check_float("head_bias_init", self.head_bias_init, -1e6, 1e6))
        if not isinstance(self.qkv_bias, bool):
            raise VitlabError(f"qkv_bias must be true or false, got {self.qkv_bias!r}")
        if not isinstance(self.name, str):
            raise VitlabError(f"name must be a string, got {self.name!r}")
        if not isinstance(self.extra, dict):
            raise VitlabError(f"extra must be a mapping, got {type(self.extra).__name__}")

    def _check_stems(self) -> None:
        if isinstance(self.resnet, dict):
            _set(self, "resnet", ResNetConfig.from_dict(self.resnet))
        if self.resnet is not None and not isinstance(self.resnet, ResNetConfig):
            raise VitlabError(f"resnet must be a ResNet config (a mapping of fields) or None, got {self.resnet!r}")
        stem = self.conv_stem or ()
        if not isinstance(stem, (list, tuple)) or len(stem) > MAX_CONV_STEM:
            raise VitlabError(f"conv_stem must be a list of at most {MAX_CONV_STEM} channel counts, got {stem!r}")
        _set(self, "conv_stem", tuple(check_int("conv_stem channels (positive)", c, 1, MAX_WIDTH) for c in stem))
        if self.arch == "vit" and self.resnet is not None and self.resnet.kind != "bit-post":
            raise VitlabError(f"a hybrid ViT's ResNet stem is the ViT code's (kind 'bit-post'), not {self.resnet.kind!r}")
        if self.conv_stem and (self.resnet is not None or self.arch != "vit"):
            raise VitlabError("conv_stem and resnet are two different stems: give one of them "
                              "(conv_stem=[] turns the conv stem off)")

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
                fit = [-(-side // self.stride) * self.stride for side in size]  # the next multiples up
                example = (f"image_size={fit[0]} (--image-size {fit[0]} on the command line)" if fit[0] == fit[1]
                           else f"image_size=({fit[0]}, {fit[1]})")
                raise VitlabError(f"image size {size} is not a multiple of the total stride {self.stride}; use a "
                                  f"size divisible by {self.stride}, e.g. {example}")
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
        """A validated config from a plain dict (config.json, YAML, overrides); one line per problem."""
        return _from_dict(cls, data, "model config")
