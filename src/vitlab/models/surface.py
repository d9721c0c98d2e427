"""What every vitlab model shares with timm's models beyond the forward: `reset_classifier`'s `global_pool`,
`pretrained_cfg`, `group_matcher`, a head assigned by hand, a clear refusal of `torch.jit.script`, the input check,
and what `forward_intermediates` / `prune_intermediate_layers` share (`feature_take_indices`, the output formats).

Where vitlab differs from timm it says so in one line instead of doing something else silently.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from vitlab.errors import VitlabError

# vitlab's pooling as timm names it: a ViT's classifier ('token', 'gap', 'map') and the ResNets' average.
TIMM_POOL = {"token": "token", "gap": "avg", "map": "map", "resnet": "avg"}


# timm's transforms know PIL's filters by name; torch's "area" has no PIL filter, box is the closest
_TIMM_INTERPOLATION = {"area": "box"}


class TimmSurface:
    """Mixed into VisionTransformer and the ResNets. `preprocess` is the evaluation preprocessing the weights
    were made for (`vitlab.load` sets it from the file; None: vitlab's default, [-1, 1] at the model's size),
    `class_names` the names of the head's outputs (None: unknown); `vitlab.save` writes both."""

    preprocess: Any = None
    class_names: list[str] | None = None
    _head_name = "head"  # where the classifier lives (torchvision's `fc` in the standard ResNet)

    def __setattr__(self, name: str, value: Any) -> None:
        """A head put in by hand (`model.head = nn.Linear(768, 10)`, torchvision's `model.fc = ...`) updates the
        config's num_classes, so `num_classes`, `pretrained_cfg` and `vitlab.save` follow it; before, the config
        kept the old count and `vitlab.save` wrote a folder `vitlab.load` could not read."""
        super().__setattr__(name, value)
        if name == self._head_name and isinstance(value, nn.Module) and "config" in self.__dict__:
            outputs = _head_outputs(value)
            if outputs is not None and outputs != self.config.num_classes:
                self.config = self.config.replace(num_classes=outputs)
                self.class_names = None

    def _pool_kind(self) -> str:
        return "resnet" if self.config.arch == "resnet" else self.config.classifier

    def _check_global_pool(self, global_pool: Any) -> None:
        """`reset_classifier(K, global_pool)`: timm's second argument. vitlab fixes the pooling at build (a ViT's
        class token exists or not), so only the model's own pooling is accepted; anything else is refused."""
        if global_pool is None:
            return
        own = TIMM_POOL[self._pool_kind()]
        if isinstance(global_pool, bool):  # reset_classifier(K, True): vitlab's keep_representation, positionally
            raise VitlabError(f"reset_classifier(num_classes, {global_pool}): the second argument is timm's "
                              f"global_pool; write keep_representation={global_pool} by name")
        if global_pool == own or (global_pool == self._pool_kind() and global_pool != "resnet"):
            return
        if self.config.arch == "resnet":
            fix = "a ResNet here always averages: leave global_pool out"
        else:
            fix = ("build the model with the pooling you want instead: create_model(name, classifier='gap') "
                   "(timm's 'avg': the mean of the tokens after the final LayerNorm, no class token), "
                   "classifier='token' or classifier='map'")
        raise VitlabError(f"reset_classifier(global_pool={global_pool!r}): this model pools with {own!r} (timm's "
                          f"name), set when it was built; vitlab does not change the pooling there as timm does: "
                          f"{fix}")

    def _forget_classes(self) -> None:
        """After a new head the stored class names no longer name its outputs."""
        self.class_names = None

    @property
    def pretrained_cfg(self) -> dict[str, Any]:
        """timm's description of the model's input, which `timm.data.resolve_model_data_config(model)` and
        `create_transform` read: size, mean/std, interpolation, crop, from `preprocess` (or vitlab's default).

        Without it timm falls back to 224 px and ImageNet's mean/std, which is wrong for a ViT at another
        size or with vitlab's [-1, 1] inputs. timm's transforms resize with PIL, which always anti-aliases:
        a record with `antialias=False` (the official checkpoints: TensorFlow's resize) is not exactly
        reproduced when shrinking."""
        cfg = self.config
        h, w = cfg.image_size
        pre = _as_dict(self.preprocess)
        channels = cfg.in_chans
        mean = tuple(pre.get("mean") or (0.5,) * channels)
        std = tuple(pre.get("std") or (0.5,) * channels)
        resize = pre.get("resize")
        crop_fraction = float(pre.get("crop_fraction") or 1.0)
        if resize:  # a shorter side before the crop: timm's scale_size = floor(size / crop_pct) gives it back
            crop_pct, crop_mode = _crop_pct(max(h, w), int(resize)), pre.get("crop_mode") or "center"
        elif crop_fraction < 1.0:
            crop_pct, crop_mode = crop_fraction, pre.get("crop_mode") or "center"
        else:  # vitlab's plain resize of the whole image to the model's size
            crop_pct, crop_mode = 1.0, "squash"
        interpolation = pre.get("interpolation") or "bilinear"
        first_conv, classifier = _first_conv_and_classifier(self)
        return {
            "architecture": cfg.name, "input_size": (channels, h, w), "fixed_input_size": False,
            "interpolation": _TIMM_INTERPOLATION.get(interpolation, interpolation), "mean": mean, "std": std,
            "crop_pct": crop_pct, "crop_mode": crop_mode, "num_classes": cfg.num_classes,
            "first_conv": first_conv, "classifier": classifier,
            "label_names": list(self.class_names) if self.class_names else None,
        }

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """timm's parameter groups, stem first and then the blocks in order (timm's own regexes for its ViT,
        ResNet and ResNetV2, whose key names vitlab shares): what timm's layer-wise LR decay
        (`create_optimizer_v2(model, layer_decay=...)`) reads. Without it timm grouped vitlab's models by
        their top-level modules and gave the head a decayed learning rate."""
        cfg = self.config
        if cfg.arch != "resnet":
            return {"stem": r"^cls_token|pos_embed|patch_embed", "blocks": [(r"^blocks\.(\d+)", None),
                                                                            (r"^norm", (99999,))]}
        if cfg.resnet.kind == "standard":
            return {"stem": r"^conv1|bn1|maxpool", "blocks": r"^layer(\d+)" if coarse else r"^layer(\d+)\.(\d+)"}
        return {"stem": r"^stem", "blocks": r"^stages\.(\d+)" if coarse else [
            (r"^stages\.(\d+)\.blocks\.(\d+)", None), (r"^norm", (99999,))]}

    @property
    def default_cfg(self) -> dict[str, Any]:
        """timm's older name of `pretrained_cfg`."""
        return self.pretrained_cfg

    def __prepare_scriptable__(self):
        """`torch.jit.script` calls this first: refuse in one line (vitlab's models are not TorchScript code)."""
        raise VitlabError(f"{type(self).__name__} cannot be compiled by torch.jit.script (unlike most timm models); "
                          "use torch.jit.trace(model.eval(), example), torch.compile(model), torch.export or "
                          "`vitlab export` (ONNX)")

    def _check_images(self, x: torch.Tensor) -> None:
        """Images (B, in_chans, H, W), or one line naming what came instead (not a convolution's message)."""
        if x.dim() != 4 or x.shape[1] != self.config.in_chans:
            c = self.config.in_chans
            hint = " (one image: add the batch dimension, x[None])" if x.dim() == 3 and x.shape[0] == c else ""
            raise VitlabError(f"expected images of shape (B, {c}, H, W), got {tuple(x.shape)}{hint}; this model "
                              f"was built with in_chans={c}")


def _head_outputs(head: nn.Module) -> int | None:
    """The classes a head gives: a Linear's outputs (the last Linear of a small stack), 0 for no head (Identity);
    None where it cannot be told."""
    if isinstance(head, nn.Identity):
        return 0
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    return linears[-1].out_features if linears else None


def _as_dict(pre: Any) -> dict[str, Any]:
    if pre is None:
        return {}
    if isinstance(pre, dict):
        return dict(pre)
    return pre.to_dict() if hasattr(pre, "to_dict") else {}


def _crop_pct(size: int, resize: int) -> float:
    """The largest crop fraction for which timm's floor(size / crop_pct) is `resize` (size / resize itself may
    land a hair above and give resize - 1)."""
    pct = size / resize
    while math.floor(size / pct) < resize:
        pct = math.nextafter(pct, 0.0)
    return pct


def _first_conv_and_classifier(model: Any) -> tuple[str, str]:
    """timm's `first_conv` and `classifier` entries: the state-dict names of the first convolution and the head."""
    cfg = model.config
    if cfg.arch == "resnet":
        return ("conv1", "fc") if cfg.resnet.kind == "standard" else ("stem.conv", "head")
    if cfg.resnet is not None:
        return "patch_embed.backbone.stem.conv", "head"
    if cfg.conv_stem:
        return "patch_embed.stem.0", "head"
    return "patch_embed.proj", "head"


def update_preprocess_size(pre: Any, old: tuple[int, int], new: tuple[int, int]) -> Any:
    """The preprocessing record for a model moved from `old` to `new` pixels: the new size, and a shorter side
    before the crop scaled with it (timm's 248 for 224 -> 425 for 384), as `vitlab.load(..., image_size=)` does."""
    if pre is None:
        return None
    d = _as_dict(pre)
    if not d:
        return pre
    d["image_size"] = list(new)
    if d.get("resize") and max(old) != max(new):
        d["resize"] = round(int(d["resize"]) * max(new) / max(old))
    return type(pre).from_dict(d) if hasattr(type(pre), "from_dict") else d


def feature_take_indices(num_features: int, indices: int | Sequence[int] | None = None) -> tuple[list[int], int]:
    """timm's `feature_take_indices`: the features to take, counted from 0, and the largest. None: all; an int n:
    the last n; a list: those indices, negative ones counted from the end. Out of range: one line (timm asserts)."""
    if indices is None:
        indices = num_features
    if isinstance(indices, bool) or not isinstance(indices, (int, Sequence)) or isinstance(indices, str):
        raise VitlabError(f"indices must be an int (the last n features) or a list of feature indices, got "
                          f"{indices!r}")
    if isinstance(indices, int):
        if not 0 < indices <= num_features:
            raise VitlabError(f"indices={indices} asks for the last {indices} features; this model has "
                              f"{num_features} (give 1 to {num_features}, or a list of indices)")
        take = list(range(num_features - indices, num_features))
    else:
        take = [_absolute_index(i, num_features) for i in indices]
    if not take:
        raise VitlabError("indices is an empty list; give at least one feature index (or None for all)")
    return take, max(take)


def _absolute_index(index: Any, num_features: int) -> int:
    if isinstance(index, bool) or not isinstance(index, int):
        raise VitlabError(f"feature index {index!r} is not an integer")
    absolute = num_features + index if index < 0 else index
    if not 0 <= absolute < num_features:
        raise VitlabError(f"feature index {index} is out of range for this model's {num_features} features "
                          f"(0 to {num_features - 1}, or -1 to -{num_features} from the end)")
    return absolute


def check_output_fmt(output_fmt: str, allowed: tuple[str, ...]) -> None:
    """timm's output formats: 'NCHW' (feature maps) or 'NLC' (tokens); the ResNets give feature maps only."""
    if output_fmt not in allowed:
        raise VitlabError(f"output_fmt={output_fmt!r}: this model gives {' or '.join(map(repr, allowed))}")


def tokens_to_maps(tokens: list[torch.Tensor], grid: tuple[int, int]) -> list[torch.Tensor]:
    """Patch tokens (B, h*w, D) -> feature maps (B, D, h, w), as timm's 'NCHW' intermediates."""
    h, w = grid
    return [t.reshape(t.shape[0], h, w, -1).permute(0, 3, 1, 2).contiguous() for t in tokens]
