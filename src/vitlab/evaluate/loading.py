"""Turn what a user names on the command line into a model: a weights file or folder, a training run
folder (its `model/`), or a registry name (random initialisation, e.g. for a from-scratch baseline)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.nn as nn

from vitlab.errors import VitlabError
from vitlab.values import split_outside_brackets, typed_model_args, yaml_problem


@dataclass
class LoadedModel:
    model: nn.Module
    class_names: list[str] | None
    preprocess: Any  # vitlab.data.Preprocess
    source: str  # 'weights', 'run' (a run folder, its model folder or one of its checkpoints) or 'registry'
    description: str
    run_config: dict | None = None
    run: Path | None = None  # the training run the model belongs to (run_of)
    checkpoint: str | None = None  # which of its checkpoints, e.g. "best"; None for the run's final model


def default_preprocess(model: nn.Module):
    """The official evaluation preprocessing for a model without a stored one: resize, [-1, 1]."""
    from vitlab.data import Preprocess

    cfg = model.config
    return Preprocess.for_model(cfg.image_size, channels=cfg.in_chans)


def is_run_folder(p: Path) -> bool:
    return p.is_dir() and (p / "model").is_dir() and ((p / "config.yaml").exists() or (p / "summary.json").exists())


def run_of(model: str | Path) -> tuple[Path | None, str | None]:
    """The training run a model path belongs to and, for one of its checkpoints, the checkpoint's name:
    RUN and RUN/model (the run's final model) -> (RUN, None); RUN/checkpoints/best.pt -> (RUN, "best");
    anything else -> (None, None). The one rule for every command that treats a run's model as the run's
    (its data, its report folder)."""
    p = Path(str(model)).expanduser()
    if is_run_folder(p):
        return p, None
    if p.name == "model" and is_run_folder(p.parent):
        return p.parent, None
    # a checkpoint of a run (finished or not): the run's config.yaml sits beside checkpoints/
    if p.is_file() and p.parent.name == "checkpoints" and (p.parent.parent / "config.yaml").is_file():
        return p.parent.parent, p.stem
    return None, None


def read_run_config(run: Path) -> dict | None:
    f = run / "config.yaml"
    if not f.exists():
        return None
    import yaml

    try:
        return yaml.safe_load(f.read_text()) or {}
    except yaml.YAMLError as exc:
        raise VitlabError(f"cannot read {f} ({yaml_problem(exc)}); fix or delete that file") from None


def run_data_kwargs(run_config: dict | None) -> dict:
    """The data settings of a training run, read tolerantly from its config.yaml."""
    if not run_config:
        return {}
    cfg = dict(run_config)
    if isinstance(cfg.get("data"), dict):  # nested {"data": {"source": ...}}
        cfg = {**cfg, **cfg["data"]}
        cfg["data"] = cfg.get("source")
    keys = {"data": "data", "classes": "classes", "per_class": "per_class", "val_fraction": "val_fraction",
            "test_fraction": "test_fraction", "seed": "seed", "data_seed": "seed"}
    return {dst: cfg[src] for src, dst in keys.items() if cfg.get(src) is not None}


def is_runs_data(given: str | None, run_config: dict | None) -> bool:
    """Whether `--data` (None: not given) names the data the run recorded (its config.yaml): evaluate and inspect
    write other data's reports to folders of their own, not over the run's."""
    from vitlab.data.load import absolute_source

    recorded = run_data_kwargs(run_config).get("data")
    return not given or (recorded is not None and absolute_source(str(given)) == absolute_source(str(recorded)))


def run_data_settings(run: Path) -> dict:
    """The data settings the training run in `run` recorded (its config.yaml), as `load_data` takes them."""
    return run_data_kwargs(read_run_config(run))


def parse_model_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """"custom(dim=32,depth=1,patch_size=4)" -> ("custom", {"dim": 32, "depth": 1, "patch_size": 4})."""
    spec = spec.strip()
    if not spec.endswith(")") or "(" not in spec:
        return spec, {}
    name, _, inner = spec[:-1].partition("(")
    import yaml

    overrides: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in split_outside_brackets(inner))):
        key, eq, value = item.partition("=")
        if not eq:
            raise VitlabError(f"bad model override {item!r} in {spec!r}; write NAME(key=value,...), e.g. custom(dim=32,depth=1,heads=2)")
        val = yaml.safe_load(value.strip().replace("(", "[").replace(")", "]"))
        overrides[key.strip()] = tuple(val) if isinstance(val, list) else val
    return name.strip(), typed_model_args(overrides, f"in {spec!r}")


def split_model_list(text: str) -> list[str]:
    """"vit-b/16,custom(dim=32,depth=1),resnet-50" -> the three specs (commas inside () kept)."""
    return [s.strip() for s in split_outside_brackets(text) if s.strip()]


_MAX_SIZE_SEARCH = 1024  # sizes tried above the data's side (a stride is at most this)


def fit_image_size(spec: str, side: int | None) -> int | None:
    """The input size for a model built from a name on `side`-pixel data: the smallest size >= `side` at which
    the spec builds, i.e. its token grid accepts it (vit-b/16 on 28 px -> 32, a custom patch_size=5 -> 30; a
    ResNet or a conv stem takes `side` itself). Where no size builds, the error is about another field (heads,
    dim ...): raised as said at `side`. The spec's own image_size= is left to the caller."""
    if side is None:
        return None
    name, overrides = parse_model_spec(spec)
    overrides.pop("image_size", None)
    return fit_size(name, overrides, side)


def fit_size(name: str, overrides: dict, side: int) -> int:
    """`fit_image_size` for a registry name and its config overrides."""
    from vitlab.models import get_config

    first: VitlabError | None = None
    for size in range(side, side + _MAX_SIZE_SEARCH):
        try:
            get_config(name, **overrides, image_size=size)
            return size
        except VitlabError as exc:
            first = first or exc
    raise first


def check_model_spec(spec: str) -> None:
    """Fail before any data is loaded when `spec` is neither a path that exists, a pretrained or hub
    checkpoint, nor a model name: `vitlab evaluate runs/typo` must say that the folder is missing, not ask
    for --data. The rule and its messages are `vitlab.weights.resolve_model`'s, shared by every command."""
    weights_path(spec)


def weights_path(spec: str | None) -> Path | None:
    """The local file/folder `spec` names, or None for a registry name (`vitlab.weights.resolve_model`:
    paths, run folders, pretrained names, `hf:ORG/NAME`, official names, downloaded into the cache). A run
    folder is returned as itself (its model/ is read by `load_for_eval`, which also reads its config)."""
    if not spec:
        return None
    from vitlab.weights import resolve_model

    resolved = resolve_model(spec)
    if resolved is None:
        return None
    p = Path(spec).expanduser()
    return p if p.exists() else resolved


def load_for_eval(
    spec: str,
    *,
    num_classes: int | None = None,
    image_size: int | None = None,
    in_chans: int | None = None,
    seed: int = 0,
    overrides: dict | None = None,
) -> LoadedModel:
    """Load `spec` (path, run folder, hf:/official name, or registry name). Registry models get
    `num_classes`/`image_size`/`in_chans`; weights get `overrides`, the config fields a file cannot tell
    (`heads=`, `classifier=`: `vitlab.load`)."""
    from vitlab.weights import load_with_meta

    p = weights_path(spec)
    if p is not None:
        run, checkpoint = run_of(p)  # a run's model, final or a checkpoint, brings the run's settings
        target, source = (p / "model" if is_run_folder(p) else p), ("weights" if run is None else "run")
        run_config = read_run_config(run) if run is not None else None
        model, meta = load_with_meta(target, image_size=image_size, **(overrides or {}))
        pre = meta.get("preprocess")
        if pre is None or isinstance(pre, dict):
            pre = _preprocess_from(pre, model)
        names = meta.get("class_names")
        return LoadedModel(model.eval(), list(names) if names else None, pre, source,
                           f"{p} ({meta.get('format', source)})", run_config, run, checkpoint)
    from vitlab.models import create_model
    from vitlab.models.registry import normalize_name

    name, overrides = parse_model_spec(spec)
    overrides.setdefault("in_chans", in_chans or 3)
    # a known name: an error now is about its arguments (dim=30 with heads=4 ...) and says so itself
    model = create_model(name, num_classes=num_classes or 1000, image_size=overrides.pop("image_size", image_size or 224),
                         seed=seed, **overrides)
    return LoadedModel(model.eval(), None, default_preprocess(model), "registry",
                       f"{normalize_name(name)}{spec[len(name):]} (random initialisation, seed {seed})")


def _preprocess_from(d: dict | None, model: nn.Module):
    if d is None:
        return default_preprocess(model)
    from vitlab.data import Preprocess

    return Preprocess.from_dict(d)
