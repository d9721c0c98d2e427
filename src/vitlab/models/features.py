"""timm's `features_only` models: `create_model(name, features_only=True, out_indices=...)` gives a module whose
forward returns the feature maps of the chosen blocks or stages, built on the model's `forward_intermediates`.

timm's defaults are kept: the last 3 blocks of a ViT (or hybrid), the stem and every stage of a ResNet; the model
is pruned after the last feature asked for, and its head dropped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from vitlab.errors import VitlabError
from vitlab.models.surface import check_output_fmt

# timm's `out_indices` when none is given: ViTs take the last 3 blocks; ResNets the stem and 4 stages
VIT_DEFAULT_OUT_INDICES = 3
RESNET_DEFAULT_OUT_INDICES = (0, 1, 2, 3, 4)
FEATURE_CFG_KEYS = ("output_fmt", "norm")


class FeatureInfo:
    """timm's `FeatureInfo`: per feature its module name, channels and reduction, read at the chosen indices."""

    def __init__(self, info: list[dict], out_indices: list[int]):
        self.info = [dict(entry, index=i) for i, entry in enumerate(info)]
        self.out_indices = tuple(out_indices)

    def get(self, key: str, idx: int | list[int] | None = None) -> Any:
        """The values of `key` at the out indices (None), at one feature index, or at a list of them."""
        if idx is None:
            return [self.info[i][key] for i in self.out_indices]
        if isinstance(idx, (list, tuple)):
            return [self.info[i][key] for i in idx]
        return self.info[idx][key]

    def get_dicts(self, keys: list[str] | None = None, idx: int | list[int] | None = None) -> Any:
        indices = self.out_indices if idx is None else idx
        pick = (lambda entry: entry) if keys is None else (lambda entry: {k: entry[k] for k in keys})
        if isinstance(indices, (list, tuple)):
            return [pick(self.info[i]) for i in indices]
        return pick(self.info[indices])

    def channels(self, idx: int | list[int] | None = None) -> Any:
        return self.get("num_chs", idx)

    def reduction(self, idx: int | list[int] | None = None) -> Any:
        return self.get("reduction", idx)

    def module_name(self, idx: int | list[int] | None = None) -> Any:
        return self.get("module", idx)

    def __getitem__(self, item: int) -> dict:
        return self.info[item]

    def __len__(self) -> int:
        return len(self.info)


class FeatureExtractor(nn.Module):
    """A model cut after its last chosen feature; `forward(x)` returns the chosen features as a list (timm's
    `FeatureGetterNet`: the model sits under `.model`, so a timm features_only state dict's keys match)."""

    def __init__(self, model: nn.Module, out_indices: int | list[int] | tuple[int, ...] | None = None,
                 output_fmt: str = "NCHW", norm: bool = False):
        super().__init__()
        if not hasattr(model, "forward_intermediates"):
            raise VitlabError(f"{type(model).__name__} has no forward_intermediates, so it cannot give features; "
                              "use a model from vitlab.create_model or vitlab.load")
        check_output_fmt(output_fmt, model.output_formats)  # before the model is cut
        indices = default_out_indices(model) if out_indices is None else out_indices
        if isinstance(indices, tuple):
            indices = list(indices)
        self.out_indices = model.prune_intermediate_layers(indices, prune_norm=not norm)
        self.model = model
        self.output_fmt = output_fmt
        self.norm = norm
        self.feature_info = FeatureInfo(model.feature_info, self.out_indices)
        self.train(model.training)  # vitlab.load gives an eval-mode model: so is its extractor

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.model.forward_intermediates(x, indices=self.out_indices, norm=self.norm,
                                                output_fmt=self.output_fmt, intermediates_only=True)


def default_out_indices(model: nn.Module) -> int | list[int]:
    """timm's default: the last 3 blocks of a ViT, the stem and up to 4 stages of a ResNet."""
    if hasattr(model, "blocks"):
        return min(VIT_DEFAULT_OUT_INDICES, len(model.blocks))
    return [i for i in RESNET_DEFAULT_OUT_INDICES if i < len(model.feature_info)]


def feature_options(overrides: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(the features_only options, the other overrides) from `create_model`'s keywords: `features_only`,
    `out_indices` and timm's `feature_cfg` (its `output_fmt` and `norm`); None where no features were asked for."""
    rest = dict(overrides)
    wanted = rest.pop("features_only", False)
    out_indices = rest.pop("out_indices", None)
    feature_cfg = rest.pop("feature_cfg", None) or {}
    if not wanted:
        if out_indices is not None or feature_cfg:
            raise VitlabError("out_indices / feature_cfg choose features: give them with features_only=True")
        return None, rest
    unknown = sorted(set(feature_cfg) - set(FEATURE_CFG_KEYS))
    if unknown:
        raise VitlabError(f"feature_cfg {unknown}: vitlab's features_only takes {', '.join(FEATURE_CFG_KEYS)} "
                          "(timm's other options pick timm's own wrapper classes)")
    return {"out_indices": out_indices, **feature_cfg}, rest
