"""The comparison people run with this paper: several backbones, each evaluated zero-shot, fine-tuned
with one identical budget, evaluated again; one table, per-epoch curves and runtimes.

For each model: (1) load it (pretrained weights, a vitlab run, or a registry name = from scratch),
(2) zero-shot evaluation on the test split (mapped head with --zero-shot-map, else a fresh untrained
head = chance; a from-scratch model is "untrained"), optionally few-shot / kNN / probe on its frozen
features, (3) fine-tune with `vitlab.train.train` on the same splits, (4) evaluate the fine-tuned
model with the same code and preprocessing. Every model sees the same data, order and settings.

The study always finishes: a model that fails (bad weights, NaN, OOM, ...) becomes a row saying why
and the others go on. It resumes: each finished model stores `<out>/<model>/result.json` with the
settings it ran with; the same command with the same --out reuses those and redoes only the rest. A model
cut short mid fine-tuning resumes that run from its last checkpoint (epoch ends and every 200 steps) when
its attempt ran with the same settings (`<out>/<model>/attempt.json`); its evaluations are redone.
The validation curves start at epoch 0: each model on the validation split as its fine-tuning starts, with the
head it starts from (its own trained head when kept, else the new zero-initialised one), except a mapped head,
whose epoch 0 is the zero-shot transfer through the map.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.nn as nn

from vitlab.errors import VitlabError


@dataclass
class CompareSettings:
    """The shared fine-tuning budget and evaluation options (defaults: the comparison studies' setup)."""

    epochs: float = 3
    lr: float = 1e-5
    batch_size: int = 16
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    decay: str = "constant"  # the comparison studies keep the learning rate fixed
    warmup_steps: int = 0
    grad_clip: float | None = None
    augment: bool = False  # False: plain resize only (no crops, no flips), identical for all models
    image_size: int | None = None  # None: a pretrained model's own size; a from-scratch model: the data's
    precision: str = "auto"
    device: str = "auto"
    # torch CPU threads of every evaluation and fine-tuning; None: decided once when the study starts (the
    # count changes the bits, so one study must not mix counts), then recorded with the settings
    threads: int | None = None
    seed: int = 0
    eval_batch_size: int = 64
    zero_shot_map: str | None = None
    train_overrides: dict[str, Any] = field(default_factory=dict)  # any other TrainConfig field
    quiet: bool = False


@dataclass
class ModelSpec:
    name: str  # what the tables call it
    spec: str  # registry name (with overrides) or path
    weights: str | None = None
    # set by check_model_specs: the local path the weights resolved to (None: a registry name), so that an
    # hf: name is looked up once, not again in every check and at load (each look-up asks the Hub)
    resolved: Path | None = field(default=None, repr=False, compare=False)
    checked: bool = field(default=False, repr=False, compare=False)
    digest: str | None = field(default=None, repr=False, compare=False)  # weights_digest(resolved), read once


def parse_models(models: str, weights: str | None = None) -> list[ModelSpec]:
    """--models "vit-b/16,resnet-50" [--weights "a.npz,-"]: '-' / '' / 'none' = no weights (from scratch)."""
    from vitlab.evaluate.loading import split_model_list

    specs = split_model_list(models)
    if not specs:
        raise VitlabError("--models is empty; give e.g. --models vit-b/16,resnet-50,resnet-152")
    ws: list[str | None] = [None] * len(specs)
    if weights:
        given = [w.strip() for w in weights.split(",")]
        if len(given) != len(specs):
            raise VitlabError(f"--weights has {len(given)} entries for {len(specs)} models; give one per model "
                              "('-' for a model trained from scratch)")
        ws = [None if w.lower() in ("", "-", "none", "scratch") else w for w in given]
    names = list(specs)
    seen: dict[str, int] = {}
    out = []
    for n, s, w in zip(names, specs, ws):
        if names.count(n) > 1:
            seen[n] = seen.get(n, 0) + 1
            n = f"{n} #{seen[n]}"
        out.append(ModelSpec(n, s, w))
    return out


def _safe(name: str) -> str:
    """A folder name for a model entry: 'vit-b/16' -> 'vit-b-16', 'custom(dim=32)' -> 'custom-dim-32'; a long
    one cut and given a hash of the whole entry (two long specs that differ at the end shared one folder)."""
    from vitlab.experiments.naming import folder_name

    return folder_name(name, collapse=True)


def _data_side(data) -> int:
    size = data.train.image_size
    return int(size if isinstance(size, int) else max(size))


def check_model_specs(models: list[ModelSpec], image_size: int | None = None, side: int | None = None) -> None:
    """Every entry resolves (weights found, or a registry name whose overrides are known fields), checked before
    the first model trains: a typo in the last of three models must not wait for the other two to train.

    A registry name is checked at the size it will be built at (`build_size`): `image_size` (--image-size), else
    the data's `side` fitted to its stride; before the data is known (side None) only its fields are checked."""
    from vitlab.evaluate.loading import parse_model_spec, weights_path
    from vitlab.experiments.naming import check_distinct

    # two entries with one folder (the same spec with spaces, 'a/b' and 'a-b'): the second deleted the first's
    # run, both rows pointed at one run folder, and every rerun was refused as made with other settings
    check_distinct([ms.name for ms in models], collapse=True)
    for ms in models:
        try:
            if not ms.checked:
                path = weights_path(ms.weights) if ms.weights else weights_path(ms.spec)
                if path is not None:
                    ms.resolved, ms.checked = path, True
                    continue
                if "(" in ms.spec and not ms.spec.rstrip().endswith(")"):
                    raise VitlabError("the overrides have no closing ')'; write NAME(key=value,...)")
                parse_model_spec(ms.spec)
                ms.checked = True
            if ms.resolved is None:  # a registry name: the size can change with the data, so checked every time
                build_size(ms.spec, image_size, side)
        except VitlabError as exc:
            # the weights too where the entry has some: an official name not in the cache offline read as a fault
            # of the --models label 'vit-b/16', which is fine
            weights = f" (its --weights {ms.weights!r})" if ms.weights else ""
            raise VitlabError(f"--models entry {ms.spec!r}{weights}: {exc}") from None


def build_size(spec: str, image_size: int | None, side: int | None) -> int | None:
    """The input size a from-scratch model is built (and trained) at, after checking its config there: the
    spec's own image_size=, else `image_size` (--image-size), else the smallest size >= the data's `side` its
    token grid accepts (`evaluate.loading.fit_image_size`: vit-b/16 on 28 px: 32; patch 5: 30). None: the
    registry default (side not known yet: the fields are checked at a size near 224)."""
    from vitlab.evaluate.loading import fit_image_size, parse_model_spec
    from vitlab.models.registry import get_config

    name, args = parse_model_spec(spec)
    fixed = args.pop("image_size", None) or image_size
    if fixed is not None:
        get_config(name, **args, image_size=fixed)  # a size that does not fit says so, with one that does
        return int(fixed if isinstance(fixed, int) else max(fixed))
    fitted = fit_image_size(spec, side or 224)
    return fitted if side else None


def check_label_family(ms: ModelSpec, config) -> None:
    """An entry with --weights is only the tables' name for them, but a registry name of another family is a
    mix-up (`--models vit-b/16,resnet-50 --weights=resnet50.pth,ViT-B_16.npz`): its row would call a ResNet
    'vit-b/16'. Refused; a free label (`my-vit`) or a name of the same family is taken as it is."""
    from vitlab.evaluate.loading import parse_model_spec
    from vitlab.models.registry import get_config

    try:
        named = get_config(parse_model_spec(ms.spec)[0]).arch
    except VitlabError:  # not a registry name: a label
        return
    if named != config.arch:
        kind = {"vit": "ViT", "resnet": "ResNet"}
        raise VitlabError(f"--models entry {ms.spec!r} names a {kind.get(named, named)}, but its --weights "
                          f"{ms.weights!r} hold a {kind.get(config.arch, config.arch)} ({config.name}); give "
                          "--weights in the order of --models, or call the entry by a label of your own")


def _load(ms: ModelSpec, data, st: CompareSettings):
    """(loaded model, preprocess, source, local weights path or None) for one entry.

    Weights and model names resolve with `weights_path`, i.e. `vitlab.weights.hub.resolve` as in every
    other command: files, folders, run folders, `hf:ORG/NAME`, official names like ViT-B_16.npz.
    """
    import re

    from vitlab.data import Preprocess
    from vitlab.evaluate.loading import load_for_eval, parse_model_spec, weights_path

    if ms.checked:
        path = ms.resolved
    else:
        path = weights_path(ms.weights) if ms.weights else weights_path(ms.spec)
    if ms.weights and path is None:
        raise VitlabError(f"--weights {ms.weights!r} for {ms.name}: no such file or folder, and not an official "
                          "checkpoint name (e.g. ViT-B_16.npz) or hf:ORG/NAME")
    if path is not None:
        # a label's overrides are what the weights cannot tell (`--models 'my-vit(classifier=token)'` for a timm
        # state dict): compare has no --model-args, and without them such weights could not be compared at all
        label, args = parse_model_spec(ms.spec) if ms.weights else (ms.spec, {})
        size = args.pop("image_size", None) or st.image_size
        try:
            lm = load_for_eval(str(path), image_size=size, overrides=args)
        except VitlabError as exc:  # the reader's advice names --model-args, a flag compare does not have
            raise VitlabError(re.sub(r"--model-args ([^\s)]+)", rf"write the --models entry as {label}(\1)",
                                     str(exc))) from None
        source = "pretrained" if lm.source == "weights" else "vitlab run"
        if ms.weights:
            check_label_family(ms, lm.model.config)
    else:
        size = build_size(ms.spec, st.image_size, _data_side(data))
        lm = load_for_eval(ms.spec, num_classes=data.num_classes, image_size=size,
                           in_chans=data.channels, seed=st.seed)
        source = "from scratch"
    cfg = lm.model.config
    # one preprocessing for every model and both evaluations: plain resize to the model's input, the
    # normalisation the weights were trained with (the fine-tuning's own evaluation transform)
    pre = Preprocess(image_size=cfg.image_size, mean=lm.preprocess.mean, std=lm.preprocess.std,
                     channels=cfg.in_chans)
    return lm, pre, source, path


RESULT_FILE = "result.json"
ATTEMPT_FILE = "attempt.json"  # the settings of the attempt under way (a killed one resumes only with the same)
STATUS_OK = "ok"
STATUS_FAILED = "failed"
_STAGE_DIRS = ("zero-shot", "fine-tuned", "finetune", RESULT_FILE, "error.txt")  # what one model attempt writes


def run_compare(
    data,
    models: list[ModelSpec],
    settings: CompareSettings,
    out_dir: str | Path,
    frozen=None,
    data_args: dict | None = None,
    reword_error: Callable[[str], str] | None = None,
) -> dict:
    """Run the whole comparison and write compare.md / .csv / .json, history.csv and three PNGs.

    Resumable: a model whose `<out>/<model>/result.json` was made with the same settings and data is
    reused, not redone; a failing model becomes a row saying why and the others go on. `reword_error`: a study
    that runs compare with flags of its own says a failure's advice in them (`transfer.finetune_error`).
    """
    import dataclasses

    import torch

    out = Path(out_dir)
    check_out_dir(out)
    check_study(data, models, settings)
    check_runs_unseen(data, models, settings, data_args)  # weights that trained on the images this study scores
    _map_source(settings.zero_shot_map)  # a missing or malformed map file fails now, once, not per model
    if settings.zero_shot_map:  # and one that does not fit the data (from-scratch models never read it)
        from vitlab.evaluate.zeroshot import check_map_fits_data

        check_map_fits_data(settings.zero_shot_map, data.class_names)
    training = training_config(settings)  # also refuses --set of what compare owns, before any folder exists
    if settings.threads is None:  # decided once: every model of the study computes with the same count
        from vitlab.runtime import study_threads

        settings = dataclasses.replace(settings, threads=study_threads(None, recorded_threads(out, models))[0])
    torch.set_num_threads(settings.threads)  # the evaluations too, not only the fine-tuning runs
    training["threads"] = settings.threads
    out.mkdir(parents=True, exist_ok=True)
    study = study_settings(data, settings, frozen, data_args)
    # check every earlier result first: a settings mismatch stops before any work, not after hours
    finished = {ms.name: finished_result(out / _safe(ms.name), model_settings(ms, study)) for ms in models}
    results = []
    for ms in models:
        if finished[ms.name] is not None:
            if not settings.quiet:
                print(f"=== {ms.name}: finished earlier, reusing {out / _safe(ms.name) / RESULT_FILE} ===", flush=True)
            results.append(finished[ms.name])
            continue
        results.append(compare_one(ms, data, settings, out / _safe(ms.name), frozen, data_args,
                                   model_settings(ms, study), reword_error))
    ok = [r for r in results if r["status"] == STATUS_OK]
    summary = {"data": data.summary(), "mcnemar": paired_tests(ok), "class_names": list(data.class_names),
               "test_class_counts": data.test.class_counts(), "data_notes": data_notes(data),
               "train_images": len(data.train), "val_images": len(data.val) if data.val is not None else 0,
               "test_images": len(data.test), "settings": {kk: v for kk, v in vars(settings).items()},
               "training": training,
               "zero_shot_map_source": _map_source(settings.zero_shot_map),
               "failed": [r["model"] for r in results if r["status"] != STATUS_OK], "models": results}
    write_outputs(summary, out)
    return summary


def check_out_dir(out: Path) -> None:
    """--out must be a folder (new, or an earlier study's): a file there would fail later as 'File exists'."""
    if out.exists() and not out.is_dir():
        raise VitlabError(f"--out {out} is a file, not a folder; give a new folder or an earlier compare's --out")


def check_study(data, models: list[ModelSpec], st: CompareSettings) -> None:
    """What needs the data, checked before any model runs: the data itself and every model at its size."""
    check_data(data, st)
    check_model_specs(models, st.image_size, _data_side(data))


# load_data's, for a run's config.yaml that lacks a key (runs recorded no test_fraction or data_seed before 52fb2fd);
# commands/evaluate.py keeps its own copy for its flags: importing vitlab.data there would load torch for --help
_SPLIT_DEFAULTS = {"seed": 0, "val_fraction": 0.1, "test_fraction": 0.1}


def check_runs_unseen(data, models: list[ModelSpec], st: CompareSettings, data_args: dict | None) -> None:
    """Refuse weights that are a vitlab training run on this same data whose training split holds images of this
    comparison's test or validation split: `--weights runs/x` trained on photos/ split with seed 1, compared with
    seed 0, scored its 'trained head' and fine-tuned rows partly on images it had learnt. Same split settings
    carve the same val/test images, so only a run with other ones is checked (its split is drawn again)."""
    from vitlab.data import load_data
    from vitlab.evaluate.loading import is_runs_data, read_run_config, run_data_kwargs, run_of

    da = data_args or {}
    source = da.get("data")
    if not source:  # an API caller that did not say which source the data is: nothing to compare with
        return
    ours = {"seed": st.seed, "val_fraction": da.get("val_fraction"), "test_fraction": da.get("test_fraction")}
    ours = {k: _SPLIT_DEFAULTS[k] if v is None else v for k, v in ours.items()}
    for ms in models:
        run = run_of(ms.resolved)[0] if ms.resolved is not None else None
        cfg = read_run_config(run) if run is not None else None
        if not cfg or not is_runs_data(str(source), cfg):
            continue
        kw = run_data_kwargs(cfg)
        theirs = {k: kw.get(k, v) for k, v in _SPLIT_DEFAULTS.items()}
        if theirs == ours:
            continue
        try:  # the run's split only (listed, not decoded where the source streams)
            runs = load_data(str(source), classes=kw.get("classes"), per_class=kw.get("per_class"),
                             in_memory=False, eval_splits=(), progress=False, report=False, **theirs)
        except VitlabError:  # the run's classes are no longer in the data: its split cannot be drawn again
            continue
        hits = []
        for what, part in (("test", data.test), ("validation", data.val)):
            found = _trained_on(runs.train, list(runs.class_names), part, list(data.class_names), what) if part else []
            if found:
                hits.append((f"{len(found)} of the {len(part)} {what} images", found[0]))
        if not hits:
            continue
        said = ", ".join(f"{k.replace('_fraction', '')} {{{k}:g}}" for k in _SPLIT_DEFAULTS)  # seed 1, val 0.1, test 0.1
        flags = " ".join(f"--{k.replace('_', '-')} {theirs[k]:g}" for k in _SPLIT_DEFAULTS if theirs[k] != ours[k])
        raise VitlabError(
            f"--models entry {ms.spec!r}: its weights are the training run {run}, which trained on "
            f"{' and '.join(h for h, _ in hits)} of this comparison (first: {hits[0][1]}): the run split {source} "
            f"with {said.format(**theirs)}, this comparison with {said.format(**ours)}; give {flags} (the run's "
            "split) so that the images scored are ones it held out, or weights not trained on this data")


def _trained_on(train, train_names: list[str], split, names: list[str], what: str) -> list[str]:
    """The images of `split` that are in `train` (another loading of the same source): by file path where both
    have paths, else by pixels and class (`data.duplicates`; in-memory sources such as IDX have no paths)."""
    theirs, ours = getattr(train, "paths", None), getattr(split, "paths", None)
    if theirs is not None and ours is not None:
        import os

        known = {os.path.abspath(p) for p in theirs}  # one spelled from 'photos', one from '/home/me/photos'
        return [p for p in ours if os.path.abspath(p) in known]
    from vitlab.data.duplicates import copies_of_training_images

    labels, train_labels = split.labels.tolist(), train.labels.tolist()
    # the same pixels under another class name are two images (a copy across classes is the data's own problem)
    return [f"{what} image {j}" for j, i in copies_of_training_images(train, split)
            if names[labels[j]] == train_names[train_labels[i]]]


def check_data(data, st: CompareSettings) -> None:
    """What the data must have for any model, checked once before the first model: at least two classes (one
    class is 100% for every model, a comparison of nothing) and a training set of at least one batch."""
    if data.num_classes < 2:
        raise VitlabError(f"the data has {data.num_classes} class ({', '.join(map(str, data.class_names))}); a "
                          "comparison needs at least 2: give more with --classes A,B")
    if data.test is None or len(data.test) == 0:  # every row is scored on it: each model failed, then a crash
        raise VitlabError(f"the data has no test split ({data.summary()}): too few images per class to carve one; "
                          "add images, give a test/ folder beside train/, or raise --test-fraction")
    batch = int(st.train_overrides.get("batch_size", st.batch_size))
    if batch > len(data.train):
        raise VitlabError(f"--batch-size {batch} is larger than the training set ({len(data.train)} images); "
                          f"use --batch-size {len(data.train)} or less, or more images (--per-class)")


# TrainConfig fields that compare sets itself, with the flag that sets them: a --set of one would make the
# run's config.yaml disagree with what it trained on (the data: a later `vitlab evaluate RUN` reads them),
# or take the run out of compare's bookkeeping (its folder, resume, thread count, model, size)
OWNED_KEYS = {
    "data": "--data", "classes": "--classes", "per_class": "--per-class", "val_fraction": "--val-fraction",
    "test_fraction": "--test-fraction", "seed": "--seed", "data_seed": "--seed", "threads": "--threads", "image_size": "--image-size",
    "model": "--models", "model_args": "--models", "weights": "--weights", "out_dir": "--out", "name": "--out",
    "resume": "--resume",
}


def check_train_overrides(overrides: dict[str, Any]) -> None:
    """Refuse a --set of a setting compare owns (OWNED_KEYS), naming compare's own flag for it."""
    for key in overrides:
        if key in OWNED_KEYS:
            raise VitlabError(f"--set {key}=... is compare's own setting (the same for every model and its "
                              f"data); use {OWNED_KEYS[key]} instead")


def recorded_threads(out: Path, models: list[ModelSpec]) -> int | None:
    """The thread count an earlier run of this study recorded (any model's result or attempt), so that a resumed
    study computes with the count it started with; None when there is none."""
    for ms in models:
        mdir = out / _safe(ms.name)
        for name, path in ((RESULT_FILE, ("settings_used", "settings", "threads")),
                           (ATTEMPT_FILE, ("settings", "threads"))):
            try:
                value = json.loads((mdir / name).read_text())
                for key in path:
                    value = value.get(key) if isinstance(value, dict) else None
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(value, int) and value > 0:
                return value
    return None


def _shared_overrides(st: CompareSettings) -> dict[str, Any]:
    """The fine-tuning settings every model gets (before its own model, weights, size and head)."""
    return dict(
        epochs=st.epochs, steps=0, batch_size=st.batch_size, eval_batch_size=st.eval_batch_size,
        optimizer=st.optimizer, lr=st.lr, weight_decay=st.weight_decay, decay=st.decay,
        warmup_steps=st.warmup_steps, warmup_epochs=0.0, grad_clip=st.grad_clip, label_smoothing=0.0,
        inception_crop=st.augment, hflip=st.augment, precision=st.precision, device=st.device,
        threads=st.threads, seed=st.seed, quiet=st.quiet, ckpt_every=200, keep_last=1, eval_every=1,
    )


# what the report says about the fine-tuning (the resolved config's values, whatever set them)
TRAINING_KEYS = ("epochs", "steps", "optimizer", "lr", "decay", "warmup_steps", "weight_decay", "batch_size",
                 "grad_clip", "label_smoothing", "inception_crop", "crop_sampler", "hflip", "seed", "threads")


def training_config(st: CompareSettings) -> dict[str, Any]:
    """The fine-tuning settings every model is trained with, resolved as `_finetune` resolves them (compare's
    flags, then --set): what compare.md describes, so that a --set epochs=3 shows as 3 epochs. Also the extra
    --set settings by name."""
    from vitlab.train import resolve_config

    check_train_overrides(st.train_overrides)
    cfg = resolve_config("finetune", overrides={**_shared_overrides(st), **st.train_overrides}).to_dict()
    out = {k: cfg[k] for k in TRAINING_KEYS}
    out["other"] = {k: cfg[k] for k in st.train_overrides if k not in TRAINING_KEYS}
    return _jsonable(out)


def _map_source(spec: str | None) -> str | None:
    from vitlab.evaluate.zeroshot import read_class_map

    return read_class_map(spec)[1] if spec else None


def _jsonable(obj: Any) -> Any:
    """The object as it reads back from JSON, so a fresh result and a reused one look the same."""
    from vitlab.evaluate.runner import _json_default

    return json.loads(json.dumps(obj, default=_json_default))


def study_settings(data, settings: CompareSettings, frozen, data_args: dict | None) -> dict:
    """Everything a finished model's numbers depend on besides the model itself (to decide reuse)."""
    import dataclasses

    st = {k: v for k, v in vars(settings).items() if k != "quiet"}  # quiet changes output only
    return _jsonable({
        "settings": st, "frozen": dataclasses.asdict(frozen) if frozen is not None else None,
        "data": {"args": data_args or {"data": data.name}, "summary": data.summary(),
                 "class_names": list(data.class_names), FILES_KEY: data_fingerprint(data)},
    })


FILES_KEY = "files_and_labels_sha256"


def data_fingerprint(data) -> str:
    """A digest of every split's files, their classes and sizes (labels alone for sources without files): a photo
    moved to the class it belongs in keeps every split's size, so the data's summary did not change and results
    made before the fix were reused beside new ones as the same data."""
    import hashlib
    import os

    h = hashlib.sha256()
    for split, ds in data.splits().items():
        labels = ds.labels.tolist()
        h.update(f"{split} {len(labels)}\n".encode())
        paths = getattr(ds, "paths", None)
        if paths is None:  # IDX, CIFAR, bundled: the labels in order
            h.update(json.dumps(labels).encode())
            continue
        for path, label in zip(paths, labels):
            try:
                size = os.stat(path).st_size  # a photo replaced under its name is (almost always) another size
            except OSError:
                size = -1
            h.update(f"{os.path.abspath(path)}\t{label}\t{size}\n".encode())
    return h.hexdigest()[:16]


def model_settings(ms: ModelSpec, study: dict) -> dict:
    model = {"spec": ms.spec, "weights": ms.weights}
    if ms.resolved is not None:  # the weights' content: a file replaced under the same name is other weights
        if ms.digest is None:  # once per study: a large checkpoint is read whole to hash it
            ms.digest = weights_digest(ms.resolved)
        model["weights_sha256"] = ms.digest
    return {**study, "model": model}


def weights_digest(path: Path) -> str:
    """SHA-256 of the weights a resolved entry names (a file; a folder's files; a run folder's model/): a model
    file written again under its name (a run trained again, a new export) had its old row reused on resume."""
    import hashlib

    from vitlab.evaluate.loading import is_run_folder

    target = Path(path) / "model" if is_run_folder(Path(path)) else Path(path)
    # a folder's own files, not its subfolders: `vitlab predict` caches its engines in MODEL/engines/, which would
    # read as other weights
    files = [target] if target.is_file() else sorted(p for p in target.iterdir() if p.is_file())
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(target) if f != target else f.name).encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]  # 64 bits tell a changed file; the full digest made the refusal unreadable


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differences(a.get(k), b.get(k), f"{where}.{k}" if where else k)]
    return [] if a == b else [f"{where.split('.')[-1]} {a!r} -> {b!r}"]


def finished_result(mdir: Path, wanted: dict) -> dict | None:
    """The stored result of a finished model if it was made with `wanted` settings; None if there is none.
    A result made with other settings is an error, never silently mixed into the new table."""
    f = mdir / RESULT_FILE
    if not f.is_file():
        return None
    try:
        stored = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # a result cut off mid-write: the model is redone
    if not isinstance(stored.get("settings_used"), dict):
        raise VitlabError(f"{f} does not record the settings it was made with; use another --out (or delete "
                          "that folder to redo the model)")
    used = _same_files_as_wanted(_threads_unrecorded_as_wanted(stored["settings_used"], wanted, mdir), wanted)
    diff = _differences(used, wanted)
    if diff:
        raise VitlabError(f"{f} was made with other settings or data ({'; '.join(diff[:3])}); rerun with the same "
                          "settings to resume, or use another --out (or delete that folder to redo the model)")
    return stored


def _same_files_as_wanted(used: dict, wanted: dict) -> dict:
    """`used` with the model's spec and weights as written now where both spellings name one file or folder:
    'st/pretrain/vit/model' and '/home/me/st/pretrain/vit/model' (`study transfer --out` given once relative,
    once absolute) are one model, and were refused as "made with other settings"."""
    import os

    before, now = used.get("model"), wanted.get("model")
    if not (isinstance(before, dict) and isinstance(now, dict)):
        return used
    same = dict(before)
    if "weights_sha256" not in before and "weights_sha256" in now:  # a result made before the content was recorded
        same["weights_sha256"] = now["weights_sha256"]
    for key in ("spec", "weights"):
        a, b = before.get(key), now.get(key)
        if isinstance(a, str) and isinstance(b, str) and a != b:
            try:
                if os.path.samefile(a, b):
                    same[key] = b
            except (OSError, ValueError):  # not both existing paths (registry names, hf: names): as written
                pass
    return _same_data_as_wanted({**used, "model": same} if same != before else used, wanted)


def _same_data_as_wanted(used: dict, wanted: dict) -> dict:
    """`used` with the data source as written now where both spellings name one source: 'photos' (a study made
    before compare recorded the absolute path) and '/home/me/photos/' are one folder, and a resume that spelled
    it the other way was refused as "made with other settings"; the data's classes and split sizes are
    compared beside it, so other files under one name are still refused."""
    from vitlab.data.load import absolute_source

    try:
        a, b = used["data"]["args"]["data"], wanted["data"]["args"]["data"]
    except (KeyError, TypeError):
        return used
    if FILES_KEY not in used["data"] and FILES_KEY in wanted["data"]:  # a result made before the files were recorded
        used = {**used, "data": {**used["data"], FILES_KEY: wanted["data"][FILES_KEY]}}
    if not (isinstance(a, str) and isinstance(b, str)) or a == b or absolute_source(a) != absolute_source(b):
        return used
    return {**used, "data": {**used["data"], "args": {**used["data"]["args"], "data": b}}}


def _threads_unrecorded_as_wanted(used: dict, wanted: dict, mdir: Path) -> dict:
    """`used` with the thread count wanted now where it recorded none: studies made before compare decided and
    recorded one count (--threads None, automatic per run) stay usable, and it is said, since another count can
    change the last bits of their numbers."""
    settings, now = used.get("settings"), wanted.get("settings")
    if not (isinstance(settings, dict) and isinstance(now, dict)) or settings.get("threads") is not None:
        return used
    if now.get("threads") is None:
        return used
    print(f"{mdir.name}: its stored result does not record its CPU thread count (made before compare recorded "
          f"one); kept, and this study now runs at {now['threads']} threads", file=sys.stderr, flush=True)
    return {**used, "settings": {**settings, "threads": now["threads"]}}


def compare_one(ms: ModelSpec, data, st: CompareSettings, mdir: Path, frozen, data_args: dict | None,
                wanted: dict, reword_error: Callable[[str], str] | None = None) -> dict:
    """One model's row: computed and stored in `mdir/result.json`, or a failure record saying why."""
    import shutil

    # an unfinished earlier attempt with the same settings resumes its fine-tuning from the last checkpoint
    # (exactly: the run's own resume); anything else it left is redone
    resumable = _resumable_finetune(mdir, wanted)
    for name in _STAGE_DIRS:
        stale = mdir / name
        if resumable is not None and stale == resumable:
            continue
        if stale.is_dir():
            shutil.rmtree(stale)
        elif stale.exists():
            stale.unlink()
    mdir.mkdir(parents=True, exist_ok=True)
    (mdir / ATTEMPT_FILE).write_text(json.dumps(wanted, indent=2))
    if resumable is not None:  # said even with --quiet: the run goes on from a checkpoint, not from the start
        print(f"=== {ms.name}: resuming its fine-tuning from {resumable / 'checkpoints'} ===", flush=True)
    elif not st.quiet:
        print(f"=== {ms.name} ===", flush=True)
    stage = ["loading"]
    try:
        record = _run_model(ms, data, st, mdir, frozen, data_args, stage)
    except Exception as exc:  # any failure of one model (load, training, NaN, OOM, a bug) must not lose the others
        return _failure(ms, mdir, stage[0], exc, reword_error)
    record = _jsonable({**record, "status": STATUS_OK, "error": None, "settings_used": wanted})
    tmp = mdir / (RESULT_FILE + ".part")  # written whole, then renamed: a kill never leaves half a result
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(mdir / RESULT_FILE)
    return record


def _has_checkpoint(run: Path) -> bool:
    from vitlab.train.checkpoint import CheckpointManager

    return CheckpointManager(run / "checkpoints").latest() is not None


def _resumable_finetune(mdir: Path, wanted: dict) -> Path | None:
    """The fine-tuning run an interrupted attempt left, if it has a checkpoint and the attempt ran with the
    settings wanted now (`attempt.json`); None: the model starts from the beginning."""
    run = mdir / "finetune"
    if not _has_checkpoint(run):
        return None
    try:
        earlier = json.loads((mdir / ATTEMPT_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return run if _same_files_as_wanted(_threads_unrecorded_as_wanted(earlier, wanted, mdir), wanted) == wanted else None


def _failure(ms: ModelSpec, mdir: Path, stage: str, exc: BaseException,
             reword_error: Callable[[str], str] | None = None) -> dict:
    """The failed model's row (one-line reason) and its full traceback in `mdir/error.txt`."""
    import gc
    import sys
    import traceback

    import torch

    reason = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, VitlabError):
        reason = f"{type(exc).__name__}: {reason}"
    elif reword_error is not None:
        reason = reword_error(reason)
    mdir.mkdir(parents=True, exist_ok=True)
    (mdir / "error.txt").write_text("".join(traceback.format_exception(exc)))
    print(f"vitlab compare: {ms.name} failed while {stage}: {reason} (traceback in {mdir / 'error.txt'}); "
          "going on with the other models", file=sys.stderr, flush=True)
    del exc
    gc.collect()  # free the failed model (an OOM must not take the next model down too)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"model": ms.name, "spec": ms.spec, "weights": ms.weights, "status": STATUS_FAILED,
            "error": f"{stage}: {reason}", "stage": stage, "history": []}


def _zero_shot(model, lm, data, pre, st: CompareSettings, name: str, source: str, split: str, frozen=None):
    """The zero-shot evaluation (mapped head, fresh head or untrained model) on one split."""
    from vitlab.evaluate.runner import evaluate_model

    return evaluate_model(model, data, pre, split=split, model_classes=lm.class_names,
                          zero_shot_map=st.zero_shot_map, frozen=frozen, batch_size=st.eval_batch_size,
                          device=st.device, seed=st.seed, progress=not st.quiet, name=name,
                          untrained=(source == "from scratch"))


LABEL_START_ZERO_HEAD = "new zero head (as fine-tuning starts)"
LABEL_START_UNTRAINED = "untrained model (zero head, as training starts)"


def _start_head(model, lm, data, st: CompareSettings, source: str) -> bool:
    """Give `model` the head its fine-tuning starts from; True when that is the head the zero-shot row evaluated.

    The model's own head is kept when its classes are the data's, also in another order: its rows are then
    put in the data's order, the mapping by name the zero-shot evaluation used (`choose_head_mode`). Any
    other head (mapped, fresh, a from-scratch model's) becomes the paper's zero-initialised one."""
    from vitlab.evaluate.runner import choose_head_mode

    if source != "from scratch":
        mode, class_map = choose_head_mode(model, list(data.class_names), lm.class_names, st.zero_shot_map)
        head = getattr(model, "head", None)
        if mode == "trained" and class_map is None:
            return True
        if mode == "trained" and isinstance(head, nn.Linear):  # the same classes in another order
            import torch

            rows = torch.tensor([c[0] for c in class_map], device=head.weight.device)
            with torch.no_grad():
                head.weight.copy_(head.weight[rows])
                if head.bias is not None:
                    head.bias.copy_(head.bias[rows])
            return True
    if hasattr(model, "reset_classifier"):
        model.reset_classifier(data.num_classes)
    return False


def _start_label(zs, keep_head: bool, source: str) -> str:
    """The name of the head fine-tuning starts from: the zero-shot row's own when kept, else the new zero head."""
    if keep_head:
        return zs.rows[0]["label"]
    return LABEL_START_UNTRAINED if source == "from scratch" else LABEL_START_ZERO_HEAD


def _epoch_zero(model, lm, data, pre, st: CompareSettings, name: str, source: str, zs) -> tuple[dict | None, bool]:
    """Give `model` its fine-tuning's starting head (`_start_head`) and return (the curves' epoch-0 point, whether
    that head is the zero-shot row's), on the validation split with the preprocessing of the training loop's
    per-epoch validation (train/ leaves it out).

    Epoch 0 is the model as its fine-tuning starts, head included, except for a mapped head: its point is the
    real zero-shot transfer (the row's label says so) although fine-tuning then starts from a zero head. A fresh
    or a from-scratch model's random head is chance and starts nothing, so the zero head it trains from is shown."""
    from vitlab.evaluate.runner import evaluate_model

    has_val = data.val is not None and len(data.val) > 0
    if zs.head_mode == "mapped" and has_val:
        mapped = _zero_shot(model, lm, data, pre, st, name, source, split="val").head_metrics
    keep_head = _start_head(model, lm, data, st, source)
    if not has_val:
        return None, keep_head
    if zs.head_mode == "mapped":
        m, label = mapped, zs.rows[0]["label"]
    else:
        m = evaluate_model(model, data, pre, split="val", model_classes=list(data.class_names), head="trained",
                           batch_size=st.eval_batch_size, device=st.device, seed=st.seed, progress=not st.quiet,
                           name=name).head_metrics
        label = _start_label(zs, keep_head, source)
    return {"epoch": 0, "step": 0, "train_loss": None, "train_acc": None, "lr": None, "time_s": 0.0,
            "val_loss": m["loss"], "val_acc": m["accuracy"], "val_macro_f1": m["macro_f1"], "evaluation": label,
            }, keep_head


def _finetune(model, lm, zs, ms: ModelSpec, data, st: CompareSettings, pre, source: str, path: Path | None,
              mdir: Path, data_args: dict | None, keep_head: bool = False):
    """Fine-tune with the shared budget from the head `_start_head` gave the model; (train result, wall-clock
    seconds)."""
    from vitlab.evaluate.loading import parse_model_spec
    from vitlab.train import resolve_config, train

    spec_name, spec_args = parse_model_spec(ms.spec)
    da = data_args or {}
    overrides = dict(
        _shared_overrides(st),
        data=str(da.get("data", data.name)), classes=da.get("classes"), per_class=da.get("per_class"),
        val_fraction=da.get("val_fraction", 0.1), test_fraction=da.get("test_fraction", 0.1),
        model=spec_name if source == "from scratch" else getattr(model.config, "name", ms.spec),
        model_args=spec_args if source == "from scratch" else {},
        weights=str(path) if path is not None else None,
        image_size=int(model.config.image_size[0]), out_dir=str(mdir), name="finetune",
        zero_head=not keep_head, mean=list(pre.mean), std=list(pre.std),
    )
    check_train_overrides(st.train_overrides)  # callers of the API too: the data keys must stay the data's
    overrides.update(st.train_overrides)
    if _has_checkpoint(mdir / "finetune"):  # left by an interrupted attempt with these settings
        overrides["resume"] = str(mdir / "finetune")
    cfg = resolve_config("finetune", overrides=overrides)
    tr = train(cfg, model=model, data=data)
    return tr, tr.wall_time_s  # a resumed run's time includes its earlier segments


def _run_model(ms: ModelSpec, data, st: CompareSettings, mdir: Path, frozen, data_args: dict | None,
               stage: list[str]) -> dict:
    """Load, zero-shot, fine-tune, evaluate one model; `stage[0]` says how far it got (for a failure's row)."""
    from vitlab.evaluate.runner import evaluate_model, write_report
    from vitlab.evaluate.zeroshot import LABEL_FINETUNED
    from vitlab.models.registry import count_parameters

    lm, pre, source, path = _load(ms, data, st)
    model: nn.Module = lm.model
    stage[0] = "evaluating zero-shot"
    zs = _zero_shot(model, lm, data, pre, st, ms.name, source, split="test", frozen=frozen)
    zs.info["model_description"] = lm.description
    write_report(zs, mdir / "zero-shot", title=f"{ms.name}: before fine-tuning ({zs.rows[0]['label']})")
    start, keep_head = _epoch_zero(model, lm, data, pre, st, ms.name, source, zs)
    start_head = _start_label(zs, keep_head, source)
    stage[0] = "fine-tuning"
    tr, train_wall = _finetune(model, lm, zs, ms, data, st, pre, source, path, mdir, data_args, keep_head=keep_head)
    stage[0] = "evaluating the fine-tuned model"
    ft = evaluate_model(tr.model, data, pre, split="test", model_classes=list(data.class_names),
                        head="trained", batch_size=st.eval_batch_size, device=st.device, seed=st.seed,
                        progress=not st.quiet, name=ms.name)
    ft.rows[0]["label"] = LABEL_FINETUNED
    ft.info["model_description"] = f"{lm.description}, fine-tuned in {tr.run_dir}"
    write_report(ft, mdir / "fine-tuned", title=f"{ms.name}: after fine-tuning")
    if not st.quiet:
        z, f = zs.head_metrics, ft.head_metrics
        print(f"{ms.name}: {zs.rows[0]['label']} {100 * z['accuracy']:.2f}% -> fine-tuned "
              f"{100 * f['accuracy']:.2f}% ({train_wall:.1f}s, {tr.images_per_s:.1f} images/s)", flush=True)
    history = [dict(h, evaluation="fine-tuning") for h in tr.history]
    ran = _run_facts(tr.run_dir)
    return {
        "model": ms.name, "spec": ms.spec, "weights": ms.weights, "source": source,
        "weights_path": str(path) if path is not None else None,
        "description": lm.description, "parameters": count_parameters(tr.model),
        "image_size": list(tr.model.config.image_size),
        "zero_shot": zs.to_dict(), "zero_shot_label": zs.rows[0]["label"], "start_head": start_head,
        "training": {k: getattr(tr.config, k, None) for k in TRAINING_KEYS} if tr.config is not None else None,
        # what the run computed with after its own resolution: `--precision auto` decides per model (bf16 for a
        # wide ViT on a CPU with fast bf16, fp32 for a ResNet), and a warm-up is capped to the run's length
        "fine_tuning_precision": ran.get("precision"), "warmup_steps_run": ran.get("warmup_steps"),
        "fine_tuned": ft.to_dict(), "history": ([start] if start else []) + history,
        "epochs": _epochs_run(tr, len(data.train)), "run_dir": str(tr.run_dir),
        "train_wall_time_s": train_wall, "train_images_per_s": tr.images_per_s,
        "train_test_accuracy": (tr.test_metrics or {}).get("accuracy"),
        "fine_tuned_correct": [int(p == y) for p, y in zip(ft.predictions, ft.labels)],
    }


def _epochs_run(tr, n_train: int) -> float:
    """Epochs the fine-tuning ran, from its last step and its steps per epoch (whole batches): `--epochs 0.5` ran
    half an epoch, and the table's count of epoch records said 1. A whole number stays an int (2, not 2.0)."""
    steps = (tr.history[-1].get("step") if tr.history else 0) or 0
    batch = getattr(tr.config, "batch_size", None) if tr.config is not None else None
    if not steps or not batch:
        return len(tr.history)
    epochs = steps / max(1, n_train // int(batch))
    return int(epochs) if float(epochs).is_integer() else round(epochs, 3)


def _run_facts(run_dir) -> dict:
    """The precision and warm-up steps a fine-tuning run used, from its summary.json ({} where unreadable)."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError, TypeError):
        return {}
    resolved = summary.get("resolved_settings") or {}
    return {"precision": summary.get("precision"), "warmup_steps": resolved.get("warmup_steps")}


def paired_tests(results: list[dict]) -> list[dict]:
    """Exact McNemar test for every pair of fine-tuned models (same test images, same order)."""
    from vitlab.evaluate.metrics import mcnemar

    out = []
    for i in range(len(results)):
        for j in range(i + 1, len(results)):
            a, b = results[i], results[j]
            t = mcnemar(a["fine_tuned_correct"], b["fine_tuned_correct"])
            out.append({"a": a["model"], "b": b["model"], **t})
    return out


TABLE_COLS = ["model", "source", "status", "zero-shot evaluation", "zero-shot acc %", "zero-shot 95% CI",
              "zero-shot macro-F1 %", "fine-tuned acc %", "fine-tuned 95% CI", "fine-tuned macro-F1 %",
              "train images", "epochs", "train time s", "train images/s", "parameters"]
CSV_COLS = ["model", "weights", "source", "status", "error", "zero_shot_evaluation", "zero_shot_accuracy",
            "zero_shot_ci95_lo", "zero_shot_ci95_hi", "zero_shot_macro_f1", "fine_tuned_accuracy",
            "fine_tuned_ci95_lo", "fine_tuned_ci95_hi", "fine_tuned_macro_f1", "train_images", "test_images",
            "epochs", "train_time_s", "train_images_per_s", "parameters", "precision", "image_size"]
PRINT_COLS = ["model", "zero-shot evaluation", "zero-shot acc %", "fine-tuned acc %", "fine-tuned macro-F1 %",
              "train time s", "train images/s", "status"]


def _ok(r: dict) -> bool:
    return r.get("status", STATUS_OK) == STATUS_OK


def _status(r: dict) -> str:
    return "ok" if _ok(r) else f"FAILED ({r['error']})"


def table_rows(summary: dict) -> list[dict]:
    """One row per model (percentages); a failed model's numbers are None and its status says why."""
    rows = []
    for r in summary["models"]:
        row = dict.fromkeys(TABLE_COLS)
        row.update({"model": r["model"], "source": r.get("source") or "-", "status": _status(r),
                    "train images": summary["train_images"]})
        if _ok(r):
            z, f = r["zero_shot"]["head"], r["fine_tuned"]["head"]
            row.update({
                "zero-shot evaluation": r["zero_shot_label"], "zero-shot acc %": 100 * z["accuracy"],
                "zero-shot 95% CI": f"{100 * z['accuracy_ci95'][0]:.2f}-{100 * z['accuracy_ci95'][1]:.2f}",
                "zero-shot macro-F1 %": 100 * z["macro_f1"], "fine-tuned acc %": 100 * f["accuracy"],
                "fine-tuned 95% CI": f"{100 * f['accuracy_ci95'][0]:.2f}-{100 * f['accuracy_ci95'][1]:.2f}",
                "fine-tuned macro-F1 %": 100 * f["macro_f1"], "epochs": r["epochs"],
                "train time s": r["train_wall_time_s"], "train images/s": r["train_images_per_s"],
                "parameters": r["parameters"],
            })
        rows.append(row)
    return rows


def csv_rows(summary: dict) -> list[dict]:
    """The same table with plain numbers (fractions, not percentages) for scripts; one row per model."""
    out = []
    for r in summary["models"]:
        row = dict.fromkeys(CSV_COLS, "")
        row.update({"model": r["model"], "weights": r.get("weights") or "", "source": r.get("source") or "",
                    "status": r.get("status", STATUS_OK), "error": r.get("error") or "",
                    "train_images": summary["train_images"], "test_images": summary["test_images"]})
        if _ok(r):
            z, f = r["zero_shot"]["head"], r["fine_tuned"]["head"]
            row.update({
                "zero_shot_evaluation": r["zero_shot_label"], "zero_shot_accuracy": z["accuracy"],
                "zero_shot_ci95_lo": z["accuracy_ci95"][0], "zero_shot_ci95_hi": z["accuracy_ci95"][1],
                "zero_shot_macro_f1": z["macro_f1"], "fine_tuned_accuracy": f["accuracy"],
                "fine_tuned_ci95_lo": f["accuracy_ci95"][0], "fine_tuned_ci95_hi": f["accuracy_ci95"][1],
                "fine_tuned_macro_f1": f["macro_f1"], "epochs": r["epochs"], "train_time_s": r["train_wall_time_s"],
                "train_images_per_s": r["train_images_per_s"], "parameters": r["parameters"],
                "precision": r.get("fine_tuning_precision") or "",
                "image_size": "x".join(map(str, r["image_size"])) if r.get("image_size") else "",
            })
        out.append(row)
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    if isinstance(v, int) and v > 9999:
        return f"{v:,}"
    return str(v).replace("|", "\\|")  # a '|' in an error message would break the Markdown row


def markdown_table(rows: list[dict], cols: list[str]) -> list[str]:
    """Markdown lines of `rows` restricted to `cols` (the printed table and compare.md share it)."""
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
            *("| " + " | ".join(_fmt(r[c]) for c in cols) + " |" for r in rows)]


HIST_COLS = ["model", "epoch", "evaluation", "train_loss", "train_acc", "val_loss", "val_acc", "val_macro_f1",
             "time_s"]


def _write_csvs(summary: dict, out: Path) -> dict[str, Path]:
    files = {"csv": out / "compare.csv", "history": out / "history.csv"}
    with files["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLS)
        w.writeheader()
        for r in csv_rows(summary):
            w.writerow({c: (f"{r[c]:.6f}" if isinstance(r[c], float) else r[c]) for c in CSV_COLS})
    with files["history"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=HIST_COLS)
        w.writeheader()
        for r in summary["models"]:
            for h in r["history"]:
                w.writerow({"model": r["model"], **{c: h.get(c) for c in HIST_COLS[1:]}})
    frozen = frozen_rows(summary)
    if frozen:  # --fewshot / --knn / --probe: one row per model and analysis, as evaluate's summary.csv
        files["frozen"] = out / "frozen.csv"
        with files["frozen"].open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FROZEN_COLS)
            w.writeheader()
            for r in frozen:
                w.writerow({c: (f"{r[c]:.6f}" if isinstance(r.get(c), float) else r.get(c)) for c in FROZEN_COLS})
    else:
        (out / "frozen.csv").unlink(missing_ok=True)
    return files


FROZEN_COLS = ["model", "method", "label", "accuracy", "ci95_lo", "ci95_hi", "macro_f1", "n_test", "train_images"]


def frozen_rows(summary: dict) -> list[dict]:
    """The frozen-feature rows (few-shot, kNN, probe) of the models that finished, each with its model's name."""
    return [dict(row, model=r["model"]) for r in summary["models"] if _ok(r) for row in r["zero_shot"]["rows"][1:]]


def _write_plots(summary: dict, out: Path) -> dict[str, Path]:
    """Curves from epoch 0 (before fine-tuning) and runtimes, for the models that finished."""
    from vitlab.evaluate.plots import plot_bars, plot_lines

    done = [r for r in summary["models"] if _ok(r)]
    if not done:
        return {}

    def series(key: str, scale: float = 1.0):
        return {r["model"]: ([h["epoch"] for h in r["history"]],
                             [None if h.get(key) is None else scale * float(h[key]) for h in r["history"]])
                for r in done}

    runtime = {"runtime": plot_bars({r["model"]: r["train_wall_time_s"] for r in done}, out / "runtime.png",
                                    "training runtime per model (wall clock)", ylabel="seconds")}
    if not summary.get("val_images"):  # no validation split (--val-fraction 0): empty axes said nothing
        for name in ("val_loss.png", "val_accuracy.png"):
            (out / name).unlink(missing_ok=True)
        return runtime
    # the split and its size on the axis: a curve on 3 validation images and one on 3,000 look alike
    on = f"on the {summary.get('val_images', 0):,} validation images"
    return {**runtime,
        "val_loss": plot_lines(series("val_loss"), out / "val_loss.png",
                               "validation loss per epoch (epoch 0 = before fine-tuning)",
                               ylabel=f"cross-entropy {on}"),
        "val_acc": plot_lines(series("val_acc", 100.0), out / "val_accuracy.png",
                              "validation accuracy per epoch (epoch 0 = before fine-tuning)",
                              ylabel=f"accuracy (%) {on}"),
    }


def _count(n: float, noun: str) -> str:
    """'1 epoch', '2 epochs', '0.5 epochs'."""
    return f"{n:g} {noun}{'' if n == 1 else 's'}"


def _ran(models: list[dict], key: str) -> dict[str, Any]:
    """{model: value} of one fact the finished models' runs recorded (`_run_facts`), where recorded."""
    return {r["model"]: r[key] for r in models if _ok(r) and r.get(key) is not None}


def _warmup_text(tr: dict, models: list[dict]) -> str:
    """The warm-up the runs used: the training caps one longer than the run to the run's steps, so the
    configured count can be one that never ran."""
    used = set(_ran(models, "warmup_steps_run").values())
    if len(used) == 1:
        (n,) = used
        return _count(n, "step") + ("" if n == tr["warmup_steps"] else f" (asked {tr['warmup_steps']}: capped to "
                                                                         "the run's length)")
    if used:
        return f"{', '.join(f'{m} {n}' for m, n in _ran(models, 'warmup_steps_run').items())} steps"
    return _count(tr["warmup_steps"], "step")


def _precision_text(st: dict, models: list[dict]) -> str:
    """The precision the fine-tuning ran in: one for all, or each model's where `auto` chose per model."""
    used = _ran(models, "fine_tuning_precision")
    if not used:  # results made before the runs' precision was recorded
        return f"precision {st.get('precision', 'auto')}"
    if len(set(used.values())) == 1:
        return f"precision {next(iter(used.values()))}"
    # the one setting that is not the same for every model: said as such, not inside "identical"
    return (f"**not identical**: precision ({st.get('precision', 'auto')}, chosen per model): "
            + ", ".join(f"{m} {p}" for m, p in used.items()))


def _sizes_text(models: list[dict]) -> str:
    """'' where every finished model ran at one input size; else the sizes, said as not identical (a model with a
    run behind it keeps the run's size, a model built from a name takes the data's, fitted to its stride)."""
    sizes = {r["model"]: "x".join(map(str, r["image_size"])) for r in models
             if _ok(r) and r.get("image_size")}
    if len(set(sizes.values())) < 2:
        return ""
    return "; **not identical**: input size " + ", ".join(f"{m} {px} px" for m, px in sizes.items())


def _describe_training(tr: dict | None, st: dict, models: list[dict] | None = None) -> str:
    """The fine-tuning settings in words, from the resolved config (`training_config`), not from the flags, and
    from what the runs recorded where their own resolution changed it (warm-up, precision)."""
    models = models or []
    if not tr:  # a summary written before the resolved config was recorded
        tr = {**st, "steps": 0, "inception_crop": st["augment"], "hflip": st["augment"], "other": {}}
    length = _count(tr["steps"], "step") if tr.get("steps") else _count(tr["epochs"], "epoch")
    crop = "crop" + (" (TF's box sampler)" if tr.get("crop_sampler") == "tf" else "")  # the finetune recipe's
    augment = [name for key, name in (("inception_crop", crop), ("hflip", "flip")) if tr.get(key)]
    text = (f"{length}, {tr['optimizer']} lr {tr['lr']:g} ({tr['decay']}, warm-up {_warmup_text(tr, models)}), "
            f"weight decay {tr['weight_decay']:g}, batch {tr['batch_size']}, "
            f"{' + '.join(augment) + ' augmentation' if augment else 'no augmentation'}, seed {tr['seed']}")
    if tr.get("grad_clip"):
        text += f", gradient clipping {tr['grad_clip']:g}"
    if tr.get("label_smoothing"):
        text += f", label smoothing {tr['label_smoothing']:g}"
    if tr.get("other"):
        text += ", " + ", ".join(f"{k} {v}" for k, v in tr["other"].items())
    precision = _precision_text(st, models)
    if precision.startswith("precision"):  # else said after the identical settings (`_markdown`)
        text += f", {precision}"
    if tr.get("threads"):
        text += f", CPU threads: {tr['threads']}"
    return text


def data_notes(data) -> list[str]:
    """What the loader said about the data (skipped files, copies of training images in the val or test split,
    classes short of --per-class): printed once on stderr while loading, so the report must keep it, or a test
    split holding copies of training photos stands in the table as unseen."""
    from vitlab.data.dataset import skipped_summary

    skipped = data.all_skipped() if hasattr(data, "all_skipped") else []
    return ([skipped_summary(skipped)] if skipped else []) + list(getattr(data, "notes", []) or [])


def _classes_text(summary: dict) -> str:
    """The class names with their test images: a class with too few images to carve a test image from (a folder
    of 2 photos) was in every training run but in no score, and the table's macro-F1 left it out unsaid."""
    names, counts = summary["class_names"], summary.get("test_class_counts")
    if not counts:  # a summary written before the counts were recorded
        return ", ".join(names)
    text = ", ".join(f"{n} ({c} test)" for n, c in zip(names, counts))
    missing = [n for n, c in zip(names, counts) if c == 0]
    if missing:
        text += (f". **Not scored: {', '.join(missing)}** (no test image; accuracy and macro-F1 are over the other "
                 "classes' test images, though the models were trained on every class)")
    return text


def _markdown(summary: dict) -> list[str]:
    from vitlab.evaluate.runner import rows_markdown

    st = summary["settings"]
    zmap = summary.get("zero_shot_map_source")
    md = [
        "# Zero-shot vs fine-tuned", "",
        f"Data: {summary['data']}. Classes: {_classes_text(summary)}.", "",
        *([f"**Data notes** (from loading): {'; '.join(summary['data_notes'])}.", ""] if summary.get("data_notes") else []),
        f"Fine-tuning, identical for every model: {_describe_training(summary.get('training'), st, summary['models'])}, "
        f"on {summary['train_images']} training images"
        + ("" if (prec := _precision_text(st, summary["models"])).startswith("precision") else f"; {prec}")
        + _sizes_text(summary["models"])
        + "; zero-shot and fine-tuned accuracy on the same "
        f"{summary['test_images']} test images with the same preprocessing. Epoch 0 of the curves: each model as "
        "its fine-tuning starts, with the head it starts from (named in the evaluation column: its own trained "
        "head, or a new zero head), except a mapped head: its epoch 0 is the zero-shot transfer through the map, "
        "and its fine-tuning then starts from a new zero head.", "",
        "Zero-shot evaluation (which kind each row is): 'zero-shot (fresh head, chance)' = pretrained backbone + "
        "new untrained head, a chance baseline by construction, not transfer; 'zero-shot (mapped ... head)' = the "
        "pretrained classifier through a class map, real zero-shot transfer"
        + (f" (map: {zmap}: {st['zero_shot_map']})" if zmap else "") + "; 'untrained model (random init, chance)' "
        "= a model trained from scratch, before training; 'trained head' = the model's own head, which already has "
        "these classes (weights trained on them, such as a run on this data): not zero-shot, the model as given, "
        "before this fine-tuning ('by class count': weights that name no classes, whose head has as many outputs "
        "as the data has classes, taken to be in the data's order). 95% CIs: Wilson score intervals. Train time: wall "
        "clock of the whole fine-tuning call (training, per-epoch validation, final test pass) on this machine; "
        "images/s: training images per second of training steps.", "",
        *markdown_table(table_rows(summary), TABLE_COLS),
    ]
    if summary.get("failed"):
        md += ["", f"**Failed: {', '.join(summary['failed'])}** (reasons in the status column, tracebacks in "
               "<model>/error.txt). Rerun the same command with the same --out to retry only these; a run that "
               "diverged diverges again with the same settings, so first make the change its status names."]
    frozen = frozen_rows(summary)
    if frozen:
        md += ["", "## Frozen features before fine-tuning (frozen.csv)", "", rows_markdown(frozen, with_model=True)]
    if summary.get("mcnemar"):
        md += ["", "## Fine-tuned models, paired (exact McNemar test on the test images)", "",
               "| model A | model B | only A right | only B right | p-value |", "|---|---|---|---|---|"]
        md += [f"| {t['a']} | {t['b']} | {t['only_a']} | {t['only_b']} | {t['p_value']:.3g} |" for t in summary["mcnemar"]]
    md += ["", "## Per epoch (validation split; epoch 0 = before fine-tuning, with the head named in the evaluation column)", "",
           "| model | epoch | evaluation | train loss | val loss | val acc % | val macro-F1 % |",
           "|---|---|---|---|---|---|---|"]
    for r in summary["models"]:
        for h in r["history"]:
            def p(key, scale=1.0, h=h):
                return "-" if h.get(key) is None else f"{scale * float(h[key]):.4f}" if scale == 1.0 else f"{scale * float(h[key]):.2f}"
            md.append(f"| {r['model']} | {h['epoch']} | {h.get('evaluation', '')} | {p('train_loss')} | {p('val_loss')} | "
                      f"{p('val_acc', 100.0)} | {p('val_macro_f1', 100.0)} |")
    figures = "val_loss.png, val_accuracy.png, runtime.png" if summary.get("val_images") else (
        "runtime.png (no validation split, so no curves)")
    md += ["", f"Figures: {figures}. Per model: <model>/zero-shot/ and "
           "<model>/fine-tuned/ (reports, confusion matrices), <model>/finetune/ (the training run), "
           "<model>/result.json (the row, reused when the study is resumed)."]
    return md


def write_outputs(summary: dict, out: Path) -> dict[str, Path]:
    """compare.csv, history.csv, the figures, compare.md and compare.json."""
    from vitlab.evaluate.runner import _json_default

    files = {**_write_csvs(summary, out), **_write_plots(summary, out)}
    files["md"] = out / "compare.md"
    files["md"].write_text("\n".join(_markdown(summary)) + "\n")
    files["json"] = out / "compare.json"
    files["json"].write_text(json.dumps(summary, indent=2, default=_json_default))
    return files
