"""The seeds' transfer study with real images and no downloads: pre-train, then zero-shot vs fine-tuned.

The seed studies take ImageNet-pretrained ViT-B/16, ResNet-50 and ResNet-152, evaluate them on a small
data set of their own (shoe / sandal / boot) without training, fine-tune them, and evaluate again. Here
the same structure runs on one real data set split in two disjoint class sets:

1. **Upstream** (the "ImageNet" of the study): every model family is pre-trained from scratch on the
   upstream classes (Fashion-MNIST's seven non-footwear classes by default) with one identical recipe
   and budget.
2. **Downstream** (the "own small data set"): the footwear classes (Sandal, Sneaker, Ankle boot) at
   several sizes (images per class). For every model and size `vitlab compare` evaluates the frozen
   pre-trained features with no training of the backbone (kNN and closed-form few-shot ridge: the
   honest analogue of zero-shot, since an upstream head has no footwear classes; the fresh head's
   chance row is kept and labelled as such), fine-tunes the whole model with one budget, and evaluates
   again on the same full downstream test set.

Everything resumes: finished pre-training runs and finished compare entries are not redone.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from vitlab.errors import VitlabError
from vitlab.experiments.naming import check_distinct, folder_name

FMNIST_FOOTWEAR = ["Sandal", "Sneaker", "Ankle boot"]
FMNIST_UPSTREAM = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Shirt", "Bag"]

# The three families, sized to a few hundred thousand parameters each for 28 px inputs (counts in the table).
# Each is a registry name with overrides, as `vitlab train --model NAME --model-args ...` takes them.
STUDY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # plain ViT as in the paper: 4x4 patches from pixels (7x7 = 49 tokens), learned position embeddings,
    # class token; the same Transformer (width 64, 6 blocks) as the hybrid below, only the stem differs
    "vit": ("custom", dict(patch_size=4, dim=64, depth=6, heads=4, mlp_dim=128, classifier="token",
                           posemb="learn", gelu="exact")),
    # hybrid (paper 3.1: patches of a CNN feature map): the conv stem of Xiao et al. 2021 + a Transformer
    # (the fashion-mnist preset's model)
    "hybrid": ("custom", dict(conv_stem=[48, 96, 192], patch_size=1, classifier="gap", posemb="sincos2d",
                              dim=64, depth=6, heads=4, mlp_dim=128, gelu="exact")),
    # a standard BatchNorm ResNet-50 (bottleneck units 3,4,6,3, v1.5) narrowed to base width 8 and given the
    # small-image stem (3x3 stride 1, no max-pool)
    "resnet": ("resnet-50-small", dict(base_width=8)),
    # the scaling study's cheaper ResNet (docs/evaluation.md, "Scaling study"): bottleneck ResNet-26 at base
    # width 8, 224 k parameters and 9.3 MMACs per 28 px image, between the ViT (206 k, 11.8 M) and the
    # hybrid (422 k, 8.3 M); the ResNet-50 above trains at 242 images/s on 2 cores and alone would take
    # most of a 2-hour scaling budget
    "resnet26": ("resnet-26-small", dict(base_width=8)),
}


@dataclass
class TransferSettings:
    data: str = "fashion-mnist"
    upstream_classes: list[str] = field(default_factory=lambda: list(FMNIST_UPSTREAM))
    downstream_classes: list[str] = field(default_factory=lambda: list(FMNIST_FOOTWEAR))
    models: list[str] = field(default_factory=lambda: ["vit", "hybrid", "resnet"])
    per_class: list[int] = field(default_factory=lambda: [10, 100, 1000])
    # pre-training: the small-data recipe, the same for every family
    pretrain_epochs: float = 10
    pretrain_batch: int = 128
    pretrain_lr: float = 2e-3
    # fine-tuning: AdamW, cosine, batch 16 (the seeds' batch), at least `finetune_min_steps` steps
    finetune_epochs: float = 3
    finetune_min_steps: int = 300
    finetune_lr: float = 1e-3
    finetune_batch: int = 16
    seed: int = 0
    threads: int | None = None  # every run's CPU threads; None: decided once at the study's start, then recorded
    device: str = "auto"  # every run's device (auto: the GPU where there is one)
    quiet: bool = False


def model_spec(name: str) -> tuple[str, dict[str, Any]]:
    """'vit' / 'hybrid' / 'resnet' / 'resnet26', or any registry spec such as 'resnet-26-small(base_width=16)'."""
    if name in STUDY_MODELS:
        spec, args = STUDY_MODELS[name]
        return spec, dict(args)
    from vitlab.evaluate.loading import parse_model_spec

    # parse_model_spec reads 'custom(dim=16' as a plain name: the message would be "unknown model" (as compare)
    if "(" in name and not name.rstrip().endswith(")"):
        raise VitlabError(f"--models entry {name!r}: the overrides have no closing ')'; write NAME(key=value,...)")
    spec, args = parse_model_spec(name)
    for key, what in (("num_classes", "classes"), ("in_chans", "channels")):
        if key in args:  # the study builds every model for its data; a second value crashed the model's build
            raise VitlabError(f"--models entry {name!r}: {key} is decided by the data's {what}; leave it out")
    return spec, args


def study_model(name: str) -> tuple[str, dict[str, Any], int | None]:
    """(registry name, overrides, input size from the spec's image_size= or None for the data's own size).
    image_size is taken out of the overrides: the study passes the size to the build itself (as compare does)."""
    spec, args = model_spec(name)
    size = args.pop("image_size", None)
    if isinstance(size, (tuple, list)) and len(set(size)) == 1:
        size = size[0]
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise VitlabError(f"--models entry {name!r}: image_size must be one whole number of pixels (square "
                          f"inputs), got {size!r}")
    return spec, args, size


def model_config(name: str, num_classes: int, side: int, channels: int):
    """The model's config for this data (its classes, channels and size, or the spec's image_size): a name,
    override or size that cannot work fails here, before anything is trained or written."""
    import difflib

    from vitlab.models.registry import get_config

    spec, args, size = study_model(name)
    try:
        return get_config(spec, num_classes=num_classes, image_size=size or side, in_chans=channels, **args)
    except VitlabError as exc:
        # 'vitt', 'hybird': a slip of the study's own short names, which the registry's hint does not know
        close = difflib.get_close_matches(name, list(STUDY_MODELS), n=1, cutoff=0.6)
        if close and str(exc).startswith("unknown model"):
            raise VitlabError(f"--models entry {name!r} is not one of the study's models ({', '.join(STUDY_MODELS)}) "
                              f"nor a registry name; did you mean {close[0]!r}?") from None
        raise


def check_models(models: list[str], example: str, *, compare_folders: bool = False) -> None:
    """Refuse an empty list, an entry given twice (its runs would count twice: as extra seeds or as an extra
    row of the same numbers), a spec that does not parse, and two entries that would share a folder."""
    if not models:
        raise VitlabError(f"--models is empty; give e.g. --models {example}")
    seen: set[str] = set()
    for name in models:
        key = "".join(name.split())  # 'custom(dim=16, depth=1)' is 'custom(dim=16,depth=1)'
        if key in seen:
            raise VitlabError(f"--models gives {name!r} twice; give each model once")
        seen.add(key)
        study_model(name)
    check_distinct(models)
    if compare_folders:  # the downstream compare names its folders by its own (collapsing) rule
        check_distinct(models, collapse=True)


def check_same_data(before: dict, identity: dict, out: Path) -> None:
    """Refuse to add runs on other data to a study whose finished runs were made on the data recorded
    (`DataSplits.identity`, as training checkpoints record it)."""
    from vitlab.data.dataset import identity_difference

    old = before.get("data_identity")
    what = identity_difference(old, identity) if old is not None else None
    if what is None:
        return
    raise VitlabError(f"{out} holds a study made on other data ({what}); use another --out, or the data it was "
                      "made with to resume it")


def read_settings(out: Path) -> dict:
    f = out / "settings.json"
    if not f.exists():
        return {}
    try:
        before = json.loads(f.read_text())
    except (OSError, ValueError) as exc:  # a settings check must not become a traceback ("unexpected failure")
        raise VitlabError(f"cannot read {f} ({type(exc).__name__}): it records the settings this study was made "
                          "with; restore it, or use another --out") from None
    if not isinstance(before, dict):
        raise VitlabError(f"{f} holds no settings record (a JSON object); restore it, or use another --out")
    return before


def settings_as_now(before: dict, data: str) -> dict:
    """The recorded settings with their data source spelled as `data` (absolute, `absolute_source`) where both name
    one source: a study run as `--data photos` and resumed as `--data /home/me/photos/` (or from another folder
    with the absolute path) was refused as one with other settings (data). Its classes and split sizes are
    checked beside it (`check_same_data`)."""
    from vitlab.data.load import absolute_source

    old = before.get("data")
    if isinstance(old, str) and old != data and absolute_source(old) == data:
        return {**before, "data": data}
    return before


@contextlib.contextmanager
def study_advice(run: Path, lr_flag: str):
    """A run that diverges (loss or weights not finite) says what the study can change: its advice named
    --grad-clip and --precision, which the studies do not have, and a rerun of the same command resumes the run
    into the same divergence (the settings of a study folder are fixed)."""
    try:
        yield
    except VitlabError as exc:
        reworded = _with_study_advice(str(exc), lr_flag)
        if reworded is None:
            raise
        raise VitlabError(f"{run.name}: {reworded}") from None


def finetune_error(text: str) -> str:
    """A downstream fine-tuning's failure in the study's words (`run_compare`'s reword_error): compare's advice
    for a diverged run names compare's flags (--lr, --grad-clip, --precision), which the study does not have."""
    return _with_study_advice(text, "--finetune-lr") or text


def _with_study_advice(text: str, lr_flag: str) -> str | None:
    """`text` with the training loop's divergence advice replaced by what the study can change; None where the
    text is no divergence."""
    from vitlab.train.loop import DIVERGENCE_ADVICE

    if not text.endswith(DIVERGENCE_ADVICE):
        return None
    return (f"{text[:-len(DIVERGENCE_ADVICE)]}; the study's settings are fixed for every run: start it again with "
            f"a lower {lr_flag} and a new --out")


def write_json(path: Path, obj: Any) -> None:
    """Write `obj` as JSON whole or not at all (a temporary file renamed over it): a study killed while writing
    its settings or a run's row left half a file, and the rerun that should resume it stopped on it."""
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(obj, indent=2))
    tmp.replace(path)


def _count(n: float, noun: str) -> str:
    """'1 epoch', '2 epochs', '0.5 epochs'."""
    return f"{n:g} {noun}{'' if n == 1 else 's'}"


def pretrain(name: str, st: TransferSettings, out: Path) -> Path:
    """Pre-train one family on the upstream classes; a finished run is reused, an interrupted one resumed."""
    from vitlab.train import resolve_config, train

    run = out / "pretrain" / folder_name(name)
    if (run / "summary.json").exists():
        if not st.quiet:
            print(f"pre-training {name}: done before ({run})", flush=True)
        return run
    spec, args, size = study_model(name)
    overrides = dict(
        data=st.data, classes=list(st.upstream_classes), model=spec, model_args=args,
        out_dir=str(run.parent),
        name=run.name, epochs=st.pretrain_epochs, batch_size=st.pretrain_batch, lr=st.pretrain_lr,
        warmup_epochs=0.5, weight_decay=0.05, label_smoothing=0.1, inception_crop=False, hflip=True,
        random_erasing=0.25, random_shift=1, seed=st.seed, quiet=st.quiet, ckpt_every=200, threads=st.threads,
        image_size=size, device=st.device,
    )
    if (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir()):
        overrides["resume"] = str(run)
    elif run.exists():  # killed before its first checkpoint: nothing to keep (a new run may not reuse the folder)
        import shutil

        shutil.rmtree(run)
    if not st.quiet:
        print(f"=== pre-training {name} ({spec} {args}) on {len(st.upstream_classes)} upstream classes ===", flush=True)
    with study_advice(run, "--pretrain-lr"):
        train(resolve_config("small-data", overrides=overrides))
    return run


def downstream_data(per_class: int, st: TransferSettings):
    from vitlab.data import load_data

    return load_data(st.data, classes=list(st.downstream_classes), per_class=per_class, val_fraction=0.1,
                     seed=st.seed, progress=not st.quiet)


def class_counts(data) -> list[int]:
    """Training images per class actually drawn (--per-class takes all a class has when it has fewer)."""
    import numpy as np

    return np.bincount(data.train.labels.numpy(), minlength=data.num_classes).tolist()


def downstream(runs: dict[str, Path], per_class: int, data, st: TransferSettings, out: Path) -> tuple[dict, dict]:
    """`vitlab compare` of the pre-trained models on the downstream data drawn with `per_class`; (its summary,
    what was used: images per class, training images, batch, steps)."""
    from vitlab.evaluate.runner import FrozenOptions
    from vitlab.experiments.compare import CompareSettings, ModelSpec, run_compare

    n_train = len(data.train)
    counts = class_counts(data)
    used = max(counts)  # = per_class unless every class had fewer
    batch = min(st.finetune_batch, n_train)  # 10 images per class leave fewer than 16 training images
    steps = max(st.finetune_min_steps, math.ceil(st.finetune_epochs * n_train / batch))
    settings = CompareSettings(
        epochs=0, lr=st.finetune_lr, batch_size=batch, optimizer="adamw", weight_decay=0.0,
        decay="cosine", seed=st.seed, quiet=st.quiet, eval_batch_size=500, threads=st.threads, device=st.device,
        # about ten validation passes per run: 10 images per class make 150 one-step "epochs"
        train_overrides={"steps": steps, "eval_every": max(1, round(math.ceil(steps / math.ceil(n_train / batch)) / 10))},
    )
    # the shots that exist: asked for more, the ridge fit would be labelled "1000-shot" on 450 per class
    frozen = FrozenOptions(knn=True, fewshot=True, shots=(used,), fewshot_seeds=1)
    models = [ModelSpec(name=name, spec=str(run / "model")) for name, run in runs.items()]
    data_args = {"data": st.data, "classes": list(st.downstream_classes), "per_class": per_class,
                 "val_fraction": 0.1}
    if not st.quiet:
        print(f"=== downstream: {used} images per class ({n_train} training images, {steps} fine-tuning "
              f"steps) ===", flush=True)
    summary = run_compare(data, models, settings, out / f"downstream-{per_class}", frozen=frozen, data_args=data_args,
                          reword_error=finetune_error)
    return summary, {"per_class": used, "per_class_requested": per_class, "class_counts": counts,
                     "train_images": n_train, "batch": batch, "steps": steps}


def _short_note(per_class: int, counts: list[int], names: list[str]) -> str | None:
    """One line when some class had fewer training images than asked (after the validation split)."""
    short = [f"{n}: {c}" for n, c in zip(names, counts) if c < per_class]
    if not short:
        return None
    return (f"vitlab study transfer: --per-class {per_class}: fewer training images than that after the "
            f"validation split ({', '.join(short)}); used all of them and report the real counts")


def _row_by_method(rows: list[dict], prefix: str) -> dict | None:
    return next((r for r in rows if str(r.get("method", "")).startswith(prefix)), None)


def collect(runs: dict[str, Path], results: dict[int, tuple[dict, dict]]) -> list[dict]:
    """One row per (model, downstream size): pre-training facts, frozen and fine-tuned metrics, runtimes."""
    from vitlab.models.registry import analytic_macs

    rows = []
    for name, run in runs.items():
        pre = json.loads((run / "summary.json").read_text())
        from vitlab.weights import read_checkpoint

        config, _, _ = read_checkpoint(run / "model")
        for _, (summary, used) in sorted(results.items()):
            entry = next((m for m in summary["models"] if m["model"] == name), None)
            row: dict[str, Any] = {
                "model": name, "parameters": pre["parameters"], "gmacs": analytic_macs(config) / 1e9,
                "pretrain_test_accuracy": pre["test_accuracy"], "pretrain_time_s": pre["wall_time_s"],
                "pretrain_test_images": (pre.get("test_metrics") or {}).get("n"), "test_images": summary["test_images"],
                "pretrain_precision": pre.get("precision"),
                **{k: used[k] for k in ("per_class", "per_class_requested", "train_images", "batch", "steps")},
            }
            if entry is None or entry.get("status", "ok") != "ok" or "fine_tuned" not in entry:
                row["error"] = (entry or {}).get("error", "missing")
                rows.append(row)
                continue
            zrows = entry["zero_shot"]["rows"]
            for key, prefix in (("knn", "knn"), ("fewshot", "fewshot"), ("fresh_head", "head")):
                r = _row_by_method(zrows, prefix)
                if r is not None:
                    row[f"{key}_accuracy"], row[f"{key}_macro_f1"] = r["accuracy"], r["macro_f1"]
                    row[f"{key}_ci95"] = [r["ci95_lo"], r["ci95_hi"]]
                    if key == "fresh_head":
                        row["fresh_head_label"] = r["label"]
            ft = entry["fine_tuned"]["head"]
            row.update(finetuned_accuracy=ft["accuracy"], finetuned_macro_f1=ft["macro_f1"],
                       finetuned_ci95=list(ft["accuracy_ci95"]), finetune_time_s=entry["train_wall_time_s"],
                       finetune_precision=entry.get("fine_tuning_precision"))
            rows.append(row)
    return rows


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


def _ci(v: list[float] | None) -> str:
    return "-" if not v else f"{100 * v[0]:.1f}-{100 * v[1]:.1f}"


def _per_class_cell(r: dict) -> str:
    asked = r.get("per_class_requested", r["per_class"])
    return f"{r['per_class']}" + ("" if asked == r["per_class"] else f" (asked {asked}: all there were)")


def _batches(rows: list[dict], st: TransferSettings) -> str:
    """'batch 16', or 'batch 16 (15 at 5 images/class)' where a size had fewer training images than a batch."""
    small = sorted({(r["per_class"], r["batch"]) for r in rows if r.get("batch") not in (None, st.finetune_batch)})
    if not small:
        return f"batch {st.finetune_batch}"
    return f"batch {st.finetune_batch} ({'; '.join(f'{b} at {n} images/class' for n, b in small)}: all its images)"


def _images(rows: list[dict], key: str, what: str) -> str:
    """' (N images)' for a count every row shares (the test sets are the same for every row), '' where unknown."""
    counts = sorted({r[key] for r in rows if r.get(key) is not None})
    return f" ({what + ' ' if what else ''}{', '.join(f'{n:,}' for n in counts)} images)" if counts else ""


def _precision_line(rows: list[dict]) -> str:
    """The precision of the pre-training and fine-tuning runs: the recipes' `auto` chooses it per model (bf16
    where this CPU computes it fast and the model gains from it), so "identical" did not cover it."""
    parts = []
    for key, what in (("pretrain_precision", "Pre-training"), ("finetune_precision", "fine-tuning")):
        per_model: dict[str, set[str]] = {}
        for r in rows:
            if r.get(key):
                per_model.setdefault(r["model"], set()).add(r[key])
        used = {p for ps in per_model.values() for p in ps}
        if len(used) == 1:
            parts.append(f"{what} precision: {next(iter(used))} for every model")
        elif used:
            parts.append(f"{what} precision **not the same for every model** (`auto` chose it per model): "
                         + "; ".join(f"{m} {', '.join(sorted(ps))}" for m, ps in per_model.items()))
    return (". ".join(p[0].upper() + p[1:] for p in parts) + ".") if parts else ""


def write_tables(rows: list[dict], st: TransferSettings, out: Path) -> Path:
    cols = ["model", "parameters", "gmacs", "pretrain_test_accuracy", "pretrain_time_s", "per_class",
            "per_class_requested", "train_images", "batch", "steps", "fresh_head_accuracy", "knn_accuracy", "knn_macro_f1", "fewshot_accuracy", "fewshot_macro_f1",
            "finetuned_accuracy", "finetuned_ci95", "finetuned_macro_f1", "finetune_time_s", "pretrain_precision",
            "finetune_precision", "error"]
    with (out / "study.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in cols})
    (out / "study.json").write_text(json.dumps({"settings": asdict(st), "rows": rows}, indent=2))
    md = [
        "# Transfer study: pre-trained on the upstream classes, evaluated and fine-tuned downstream", "",
        f"Data: {st.data}. Upstream (pre-training) classes: {', '.join(st.upstream_classes)}"
        f"{_images(rows, 'pretrain_test_images', 'upstream test accuracy on')}. Downstream "
        f"classes: {', '.join(st.downstream_classes)}; the downstream test set is the source's whole test split "
        f"of those classes{_images(rows, 'test_images', '')}, the same for every row. One seed ({st.seed}): the "
        "splits, subsets, initialisations and data order of every run.", "",
        f"Pre-training, identical for every model: the small-data recipe, {_count(st.pretrain_epochs, 'epoch')}, batch "
        f"{st.pretrain_batch}, AdamW lr {st.pretrain_lr:g}, flip + random erasing + 1-pixel shift. Fine-tuning, "
        f"identical for every model: AdamW lr {st.finetune_lr:g}, cosine, {_batches(rows, st)}, "
        f"max({_count(st.finetune_min_steps, 'step')}, {_count(st.finetune_epochs, 'epoch')}), no augmentation. "
        f"CPU threads: {st.threads} for every run (decided at the study's start, recorded in settings.json; the "
        "same count reproduces these numbers). " + _precision_line(rows), "",
        "Columns: *fresh head* = the pre-trained backbone with a new untrained head (chance by construction, "
        "not transfer); *kNN* and *few-shot ridge* = frozen pre-trained features, no backbone training "
        "(the analogue of zero-shot here: the upstream head has none of the downstream classes); *fine-tuned* = the "
        "whole model trained on the downstream images. Accuracy and macro-F1 in %, 95 % Wilson intervals. "
        f"*Parameters*: the pre-trained model, its {len(st.upstream_classes)}-class upstream head included (the "
        f"fine-tuned model swaps it for a {len(st.downstream_classes)}-class one).", "",
        "| model | parameters | MMACs/image | upstream test acc % | pre-train s | images/class | fresh head % "
        "| kNN acc % (F1) | few-shot ridge acc % (F1) | fine-tuned acc % | 95 % CI | fine-tuned F1 % | fine-tune s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("error"):
            md.append(f"| {r['model']} | {r['parameters']:,} | | | | {_per_class_cell(r)} | failed: {r['error']} "
                      "| | | | | | |")
            continue
        md.append(
            # MMACs as the scaling study's table (0.0118 GMACs read as nothing); csv and json keep "gmacs"
            f"| {r['model']} | {r['parameters']:,} | {1000 * r['gmacs']:,.1f} | {_pct(r['pretrain_test_accuracy'])} | "
            f"{r['pretrain_time_s']:.0f} | {_per_class_cell(r)} | {_pct(r.get('fresh_head_accuracy'))} | "
            f"{_pct(r.get('knn_accuracy'))} ({_pct(r.get('knn_macro_f1'))}) | "
            f"{_pct(r.get('fewshot_accuracy'))} ({_pct(r.get('fewshot_macro_f1'))}) | "
            f"{_pct(r['finetuned_accuracy'])} | {_ci(r['finetuned_ci95'])} | {_pct(r['finetuned_macro_f1'])} | "
            f"{r['finetune_time_s']:.0f} |")
    md += ["", "Figure: study.png (accuracy against downstream images per class). Per size: downstream-N/ "
           "(the compare tables, validation curves from epoch 0, runtimes, reports). Pre-training runs: pretrain/."]
    path = out / "study.md"
    path.write_text("\n".join(md) + "\n")
    return path


def plot_study(rows: list[dict], out: Path) -> Path:
    """Accuracy against downstream images per class (log x): fine-tuned solid with CI band, kNN dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    models = list(dict.fromkeys(r["model"] for r in rows))
    for i, name in enumerate(models):
        pts = [r for r in rows if r["model"] == name and not r.get("error")]
        if not pts:
            continue
        color = f"C{i}"
        xs = [r["per_class"] for r in pts]
        ax.plot(xs, [100 * r["finetuned_accuracy"] for r in pts], "o-", color=color, label=f"{name} fine-tuned")
        ax.fill_between(xs, [100 * r["finetuned_ci95"][0] for r in pts], [100 * r["finetuned_ci95"][1] for r in pts],
                        color=color, alpha=0.15)
        if all("knn_accuracy" in r for r in pts):
            ax.plot(xs, [100 * r["knn_accuracy"] for r in pts], "s--", color=color, alpha=0.8,
                    label=f"{name} frozen kNN")
    ax.set_xscale("log")
    sizes = sorted({r["per_class"] for r in rows})
    ax.set_xticks(sizes, [str(n) for n in sizes])  # the sizes run, not log-scale labels such as 6x10^0
    ax.minorticks_off()
    ax.set_xlabel("downstream training images per class (log scale)")
    tested = sorted({r["test_images"] for r in rows if r.get("test_images")})  # one downstream test set
    ax.set_ylabel("test accuracy (%)" + (f" on {', '.join(f'{n:,}' for n in tested)} test images" if tested else ""))
    ax.set_title("Transfer from the upstream classes: frozen features vs fine-tuned")
    ax.grid(alpha=0.3)
    # below the axes: beside them, a long legend squeezed the axes until the title was cut off
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=9, frameon=False)
    path = out / "study.png"
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return path


def class_set(flag: str, items: list[str], names: list[str]) -> list[int]:
    """The class indices of one of --upstream / --downstream: names (any case) or numbers both mean a class of
    the data, so '0' and 'T-shirt/top' are one class; empty and one-class lists are refused."""
    from vitlab.data.splits import parse_classes, resolve_classes

    requested = parse_classes(list(items))
    if not requested:  # an empty list reached the training as "all classes"
        raise VitlabError(f"{flag} is empty; give class names or numbers separated by commas")
    out: list[int] = []
    for item in requested:
        try:
            (idx,) = resolve_classes([item], names)
        except VitlabError as exc:
            raise VitlabError(f"{flag}: {exc}") from None
        if idx in out:
            raise VitlabError(f"{flag} gives class {names[idx]!r} twice")
        out.append(idx)
    if len(out) < 2:  # one class: every prediction is right, 100 % says nothing
        raise VitlabError(f"{flag} has one class ({names[out[0]]}); a classifier needs at least 2")
    return out


def _class_sets(st: TransferSettings, names: list[str]) -> tuple[list[int], list[int]]:
    up = class_set("--upstream", st.upstream_classes, names)
    down = class_set("--downstream", st.downstream_classes, names)
    both = [names[i] for i in up if i in down]
    if both:
        raise VitlabError(f"upstream and downstream classes must be disjoint; both have {both}")
    return up, down


def _same_classes(a: Any, b: Any, names: list[str]) -> bool:
    from vitlab.data.splits import parse_classes, resolve_classes

    try:
        return resolve_classes(parse_classes(a) or [], names) == resolve_classes(parse_classes(b) or [], names)
    except VitlabError:
        return False


def _check_settings(before: dict, now: dict, names: list[str], out: Path) -> None:
    """Refuse changed settings (models and sizes only add or skip parts); class lists compare as classes."""
    before = dict(before)
    for key in ("upstream_classes", "downstream_classes"):
        if key in before and _same_classes(before[key], now[key], names):
            before[key] = now[key]
    selection = ("models", "per_class", "data_identity")  # the data has its own check and message
    changed = sorted(k for k in now if k in before and before[k] != now[k] and k not in selection)
    if changed:
        raise VitlabError(f"{out} holds a study with other settings ({', '.join(changed)}); "
                          "use another --out or the same settings to resume it")
    check_same_data(before, now["data_identity"], out)


def _start(st: TransferSettings, out: Path) -> tuple[TransferSettings, dict, str, TransferSettings]:
    """Check everything that can fail before the study folder is written; (settings with the thread count
    decided, the record for settings.json, why that count, the settings as the report shows them: the class
    lists as the data names them, '0' -> 'T-shirt/top')."""
    from vitlab.data import load_data

    check_models(st.models, "vit,hybrid,resnet", compare_folders=True)
    from vitlab.runtime import resolve_device

    resolve_device(st.device)  # --device cuda without a GPU: one line before the study folder exists
    if not st.per_class or any(n < 1 for n in st.per_class):
        raise VitlabError(f"--per-class sizes must be positive, got {st.per_class}")
    from vitlab.data.load import absolute_source

    # recorded (settings.json) and given to every run as the absolute path: the same study from another folder
    st = replace(st, data=absolute_source(st.data))
    source = load_data(st.data, val_fraction=0.1, seed=st.seed, progress=False)  # a typo in --data fails here
    names = list(source.class_names)
    up, down = _class_sets(st, names)
    # the pre-training's batch has no flag here: train's refusal ("use --batch-size N") named a flag the study
    # lacks, and came after settings.json was written
    n_up = sum(int(y) in up for y in source.train.labels.tolist())
    if n_up < st.pretrain_batch:
        raise VitlabError(f"the upstream classes have {n_up} training images, fewer than one pre-training batch "
                          f"({st.pretrain_batch}); add images to them, or give more classes with --upstream")
    for name in st.models:
        model_config(name, len(up), int(source.train.image_size[0]), source.channels)
    before = settings_as_now(read_settings(out), st.data)
    from vitlab.runtime import study_threads

    threads, why = study_threads(st.threads, before.get("threads"))
    st = replace(st, threads=threads)
    now = {k: v for k, v in asdict(st).items() if k != "quiet"}
    now["data_identity"] = source.identity()
    _check_settings(before, now, names, out)
    shown = replace(st, upstream_classes=[names[i] for i in up], downstream_classes=[names[i] for i in down])
    return st, now, why, shown


def run_transfer_study(st: TransferSettings, out_dir: str | Path) -> list[dict]:
    """Pre-train every family, run the downstream comparison at every size, write study.md/.csv/.json/.png."""
    import torch

    out = Path(out_dir)
    st, now, why, shown = _start(st, out)  # nothing is written before every check passed
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "settings.json", now)
    print(f"vitlab study transfer: {st.threads} CPU threads for every run ({why}; recorded in settings.json)",
          file=sys.stderr, flush=True)
    torch.set_num_threads(st.threads)  # the compare evaluations run in this process
    runs = {name: pretrain(name, st, out) for name in st.models}
    results: dict[int, tuple[dict, dict]] = {}
    drawn: dict[tuple, int] = {}
    for n in sorted(set(st.per_class)):
        data = downstream_data(n, st)
        counts = tuple(class_counts(data))
        note = _short_note(n, list(counts), list(data.class_names))
        if counts in drawn:  # asked for more than there is, twice: the same images, one row
            print(f"vitlab study transfer: --per-class {n} draws the same {max(counts)} images per class as "
                  f"--per-class {drawn[counts]}; reported once", file=sys.stderr, flush=True)
            continue
        if note:
            print(note, file=sys.stderr, flush=True)
        drawn[counts] = n
        results[n] = downstream(runs, n, data, st, out)
    rows = collect(runs, results)
    write_tables(rows, shown, out)
    plot_study(rows, out)
    return rows
