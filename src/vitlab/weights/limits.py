"""What the checkpoint readers check before they allocate: the shapes a config implies against the
tensors in a file, stored preprocessing against the model, and the sizes of the small JSON files.

The model-config maxima (depth, width, image size, ...) live in `vitlab.limits`, next to the
config they bound; docs/weights.md ("Limits") lists them all.
"""

from __future__ import annotations

from typing import Any

from vitlab.errors import VitlabError
from vitlab.limits import (  # noqa: F401 (re-exported: the readers' one place for bounds)
    LIMITS_DOC,
    MAX_DEPTH,
    MAX_IMAGE_SIZE,
    MAX_IN_CHANS,
    MAX_NUM_CLASSES,
    MAX_WIDTH,
    check_float,
    check_int,
    check_size_pair,
)

MAX_JSON_BYTES = 16 * 2**20  # config.json, preprocessor_config.json, shard indexes
MAX_SHARDS = 4096  # files a sharded Hugging Face index may name


# ------------------------------------------------------------------------------- expected shapes
def model_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """The state-dict shapes of the model `config` describes, from a build on the meta device
    (no memory, no init time); call it only on a validated config."""
    import torch

    from vitlab.models.registry import build_model

    with torch.device("meta"):
        model = build_model(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _first(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" ... ({len(items)} in all)" if len(items) > n else "")


def shape_problems(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]]) -> list[str]:
    """'missing keys ...', 'unexpected keys ...', 'shape mismatch ...' for two name -> shape maps."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    mismatched = [f"{k} (expected {tuple(expected[k])}, found {tuple(found[k])})"
                  for k in expected if k in found and tuple(expected[k]) != tuple(found[k])]
    problems = []
    if missing:
        problems.append(f"missing keys {_first(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {_first(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatch {_first(mismatched)}")
    return problems


def check_shapes_fit(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], source: str) -> None:
    """One VitlabError when the tensors in a file are not exactly those of the model its config describes."""
    problems = shape_problems(expected, found)
    if problems:
        raise VitlabError(f"{source} does not fit the model its config describes: " + "; ".join(problems))


# ------------------------------------------------------------------------------- preprocessing
def _per_channel(name: str, value: Any, channels: int, source: str) -> list[float]:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(values) not in (1, channels) and not (channels == 1 and len(values) == 3):
        raise VitlabError(f"{source}: preprocessing {name} has {len(values)} values for {channels} channels; "
                          f"give 1 or {channels}")
    return [check_float(f"{source}: preprocessing {name}", v, -1e6, 1e6) for v in values]


def validate_preprocess(pre: dict | None, config: Any, source: str = "checkpoint") -> dict | None:
    """Refuse stored preprocessing that cannot go with the model: sizes out of bounds, a ViT input size
    other than the model's (its position embeddings fit one grid), std 0, non-finite mean/std.

    Returns the dict unchanged (None stays None); every problem is one VitlabError line."""
    if pre is None:
        return None
    if not isinstance(pre, dict):
        raise VitlabError(f"{source}: stored preprocessing must be a JSON object, got {type(pre).__name__}")
    size = check_size_pair(f"{source}: preprocessing image_size", pre.get("image_size", config.image_size))
    if config.arch == "vit" and size != tuple(config.image_size):
        raise VitlabError(
            f"{source}: stored preprocessing image_size {list(size)} does not match the model's input size "
            f"{list(config.image_size)} (its position embeddings fit that grid); set it to "
            f"{list(config.image_size)} in the file"
        )
    channels = check_int(f"{source}: preprocessing channels", pre.get("channels", config.in_chans), 1, MAX_IN_CHANS)
    if channels != config.in_chans:  # predict would feed the model images it cannot take
        raise VitlabError(f"{source}: stored preprocessing channels {channels} does not match the model's "
                          f"in_chans {config.in_chans}; set it to {config.in_chans} in the file")
    _per_channel("mean", pre.get("mean", 0.5), channels, source)
    stds = _per_channel("std", pre.get("std", 0.5), channels, source)
    if any(s == 0 for s in stds):
        raise VitlabError(f"{source}: stored preprocessing std {stds} contains 0 (a division by zero); "
                          "fix std in the file")
    crop = check_float(f"{source}: preprocessing crop_fraction", pre.get("crop_fraction", 1.0), 0.0, 1.0,
                       include_low=False)
    resize = pre.get("resize")
    if resize is not None:
        check_int(f"{source}: preprocessing resize", resize, 1, MAX_IMAGE_SIZE)
    elif crop < 1.0 and round(max(size) / crop) > MAX_IMAGE_SIZE:  # the resize a crop fraction implies
        raise VitlabError(f"{source}: preprocessing crop_fraction {crop} resizes to {round(max(size) / crop)} px, "
                          f"above {MAX_IMAGE_SIZE} ({LIMITS_DOC}); fix crop_fraction in the file")
    from vitlab.data.preprocess import CROP_MODES, CROP_OFFSETS, INTERPOLATIONS

    if pre.get("interpolation", "bilinear") not in INTERPOLATIONS:
        raise VitlabError(f"{source}: preprocessing interpolation must be one of {INTERPOLATIONS}, "
                          f"got {pre.get('interpolation')!r}")
    if pre.get("crop_mode", "center") not in CROP_MODES:
        raise VitlabError(f"{source}: preprocessing crop_mode must be one of {CROP_MODES}, got {pre.get('crop_mode')!r}")
    if pre.get("crop_offset", "round") not in CROP_OFFSETS:
        raise VitlabError(f"{source}: preprocessing crop_offset must be one of {CROP_OFFSETS}, got "
                          f"{pre.get('crop_offset')!r}")
    if not isinstance(pre.get("antialias", True), bool):  # a string "false" would read as true
        raise VitlabError(f"{source}: preprocessing antialias must be true or false, got {pre.get('antialias')!r}; "
                          "fix it in the file")
    return pre
