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

import csv
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vitlab.errors import VitlabError

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
    quiet: bool = False


def model_spec(name: str) -> tuple[str, dict[str, Any]]:
    """'vit' / 'hybrid' / 'resnet' / 'resnet26', or any registry spec such as 'resnet-26-small(base_width=16)'."""
    if name in STUDY_MODELS:
        spec, args = STUDY_MODELS[name]
        return spec, dict(args)
    from vitlab.evaluate.loading import parse_model_spec

    return parse_model_spec(name)


def _safe(name: str) -> str:
    out = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)
    return out.strip("-")[:60] or "model"


def _count(n: float, noun: str) -> str:
    """'1 epoch', '2 epochs', '0.5 epochs'."""
    return f"{n:g} {noun}{'' if n == 1 else 's'}"


def pretrain(name: str, st: TransferSettings, out: Path) -> Path:
    """Pre-train one family on the upstream classes; a finished run is reused, an interrupted one resumed."""
    from vitlab.train import resolve_config, train

    run = out / "pretrain" / _safe(name)
    if (run / "summary.json").exists():
        if not st.quiet:
            print(f"pre-training {name}: done before ({run})", flush=True)
        return run
    spec, args = model_spec(name)
    overrides = dict(
        data=st.data, classes=list(st.upstream_classes), model=spec, model_args=args, out_dir=str(run.parent),
        name=run.name, epochs=st.pretrain_epochs, batch_size=st.pretrain_batch, lr=st.pretrain_lr,
        warmup_epochs=0.5, weight_decay=0.05, label_smoothing=0.1, inception_crop=False, hflip=True,
        random_erasing=0.25, random_shift=1, seed=st.seed, quiet=st.quiet, ckpt_every=200,
    )
    if (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir()):
        overrides["resume"] = str(run)
    elif run.exists():  # killed before its first checkpoint: nothing to keep (a new run may not reuse the folder)
        import shutil

        shutil.rmtree(run)
    if not st.quiet:
        print(f"=== pre-training {name} ({spec} {args}) on {len(st.upstream_classes)} upstream classes ===", flush=True)
    train(resolve_config("small-data", overrides=overrides))
    return run


def downstream(runs: dict[str, Path], per_class: int, st: TransferSettings, out: Path) -> dict:
    """`vitlab compare` of the pre-trained models on `per_class` downstream images per class."""
    from vitlab.data import load_data
    from vitlab.evaluate.runner import FrozenOptions
    from vitlab.experiments.compare import CompareSettings, ModelSpec, run_compare

    data = load_data(st.data, classes=list(st.downstream_classes), per_class=per_class, val_fraction=0.1,
                     seed=st.seed, progress=not st.quiet)
    n_train = len(data.train)
    batch = min(st.finetune_batch, n_train)  # 10 images per class leave fewer than 16 training images
    steps = max(st.finetune_min_steps, math.ceil(st.finetune_epochs * n_train / batch))
    settings = CompareSettings(
        epochs=0, lr=st.finetune_lr, batch_size=batch, optimizer="adamw", weight_decay=0.0,
        decay="cosine", seed=st.seed, quiet=st.quiet, eval_batch_size=500,
        # about ten validation passes per run: 10 images per class make 150 one-step "epochs"
        train_overrides={"steps": steps, "eval_every": max(1, round(math.ceil(steps / math.ceil(n_train / batch)) / 10))},
    )
    frozen = FrozenOptions(knn=True, fewshot=True, shots=(per_class,), fewshot_seeds=1)
    models = [ModelSpec(name=name, spec=str(run / "model")) for name, run in runs.items()]
    data_args = {"data": st.data, "classes": list(st.downstream_classes), "per_class": per_class,
                 "val_fraction": 0.1}
    if not st.quiet:
        print(f"=== downstream: {per_class} images per class ({n_train} training images, {steps} fine-tuning "
              f"steps) ===", flush=True)
    return run_compare(data, models, settings, out / f"downstream-{per_class}", frozen=frozen, data_args=data_args)


def _row_by_method(rows: list[dict], prefix: str) -> dict | None:
    return next((r for r in rows if str(r.get("method", "")).startswith(prefix)), None)


def collect(runs: dict[str, Path], results: dict[int, dict]) -> list[dict]:
    """One row per (model, downstream size): pre-training facts, frozen and fine-tuned metrics, runtimes."""
    from vitlab.models.registry import analytic_macs

    rows = []
    for name, run in runs.items():
        pre = json.loads((run / "summary.json").read_text())
        from vitlab.weights import read_checkpoint

        config, _, _ = read_checkpoint(run / "model")
        for per_class, summary in sorted(results.items()):
            entry = next((m for m in summary["models"] if m["model"] == name), None)
            row: dict[str, Any] = {
                "model": name, "parameters": pre["parameters"], "gmacs": analytic_macs(config) / 1e9,
                "pretrain_test_accuracy": pre["test_accuracy"], "pretrain_time_s": pre["wall_time_s"],
                "per_class": per_class, "train_images": summary.get("train_images"),
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
                       finetuned_ci95=list(ft["accuracy_ci95"]), finetune_time_s=entry["train_wall_time_s"])
            rows.append(row)
    return rows


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


def _ci(v: list[float] | None) -> str:
    return "-" if not v else f"{100 * v[0]:.1f}-{100 * v[1]:.1f}"


def write_tables(rows: list[dict], st: TransferSettings, out: Path) -> Path:
    cols = ["model", "parameters", "gmacs", "pretrain_test_accuracy", "pretrain_time_s", "per_class", "train_images",
            "fresh_head_accuracy", "knn_accuracy", "knn_macro_f1", "fewshot_accuracy", "fewshot_macro_f1",
            "finetuned_accuracy", "finetuned_ci95", "finetuned_macro_f1", "finetune_time_s", "error"]
    with (out / "study.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in cols})
    (out / "study.json").write_text(json.dumps({"settings": asdict(st), "rows": rows}, indent=2))
    md = [
        "# Transfer study: pre-trained on the upstream classes, evaluated and fine-tuned downstream", "",
        f"Data: {st.data}. Upstream (pre-training) classes: {', '.join(st.upstream_classes)}. Downstream "
        f"classes: {', '.join(st.downstream_classes)}; the downstream test set is the source's whole test split "
        "of those classes, the same for every row.", "",
        f"Pre-training, identical for every model: the small-data recipe, {_count(st.pretrain_epochs, 'epoch')}, batch "
        f"{st.pretrain_batch}, AdamW lr {st.pretrain_lr:g}, flip + random erasing + 1-pixel shift. Fine-tuning, "
        f"identical for every model: AdamW lr {st.finetune_lr:g}, cosine, batch {st.finetune_batch}, "
        f"max({_count(st.finetune_min_steps, 'step')}, {_count(st.finetune_epochs, 'epoch')}), no augmentation.", "",
        "Columns: *fresh head* = the pre-trained backbone with a new untrained head (chance by construction, "
        "not transfer); *kNN* and *few-shot ridge* = frozen pre-trained features, no backbone training "
        "(the analogue of zero-shot here: the upstream head has none of the downstream classes); *fine-tuned* = the "
        "whole model trained on the downstream images. Accuracy and macro-F1 in %, 95 % Wilson intervals. "
        f"*Parameters*: the pre-trained model, its {len(st.upstream_classes)}-class upstream head included (the "
        f"fine-tuned model swaps it for a {len(st.downstream_classes)}-class one).", "",
        "| model | parameters | GMACs/image | upstream test acc % | pre-train s | images/class | fresh head % "
        "| kNN acc % (F1) | few-shot ridge acc % (F1) | fine-tuned acc % | 95 % CI | fine-tuned F1 % | fine-tune s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("error"):
            md.append(f"| {r['model']} | {r['parameters']:,} | | | | {r['per_class']} | failed: {r['error']} "
                      "| | | | | | |")
            continue
        md.append(
            f"| {r['model']} | {r['parameters']:,} | {r['gmacs']:.4f} | {_pct(r['pretrain_test_accuracy'])} | "
            f"{r['pretrain_time_s']:.0f} | {r['per_class']} | {_pct(r.get('fresh_head_accuracy'))} | "
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
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Transfer from the upstream classes: frozen features vs fine-tuned")
    ax.grid(alpha=0.3)
    # below the axes: beside them, a long legend squeezed the axes until the title was cut off
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=9, frameon=False)
    path = out / "study.png"
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return path


def _preflight(st: TransferSettings) -> None:
    """Both class sets exist in the data and every model spec builds a config."""
    from vitlab.data import load_data
    from vitlab.models.registry import get_config

    for name in st.models:
        spec, args = model_spec(name)
        get_config(spec, **args)
    for classes in (st.upstream_classes, st.downstream_classes):
        load_data(st.data, classes=list(classes), per_class=1, seed=st.seed, progress=False)


def run_transfer_study(st: TransferSettings, out_dir: str | Path) -> list[dict]:
    """Pre-train every family, run the downstream comparison at every size, write study.md/.csv/.json/.png."""
    out = Path(out_dir)
    if not st.models:
        raise VitlabError("--models is empty; give e.g. --models vit,hybrid,resnet")
    if any(n < 1 for n in st.per_class):
        raise VitlabError(f"--per-class sizes must be positive, got {st.per_class}")
    overlap = {c.lower() for c in st.upstream_classes} & {c.lower() for c in st.downstream_classes}
    if overlap:
        raise VitlabError(f"upstream and downstream classes must be disjoint; both have {sorted(overlap)}")
    _preflight(st)  # a typo in --data or --models fails here, before the folder is tied to these settings
    out.mkdir(parents=True, exist_ok=True)
    settings_file = out / "settings.json"
    now = {k: v for k, v in asdict(st).items() if k != "quiet"}
    if settings_file.exists():
        before = json.loads(settings_file.read_text())
        changed = sorted(k for k in now if k in before and before[k] != now[k] and k not in ("models", "per_class"))
        if changed:
            raise VitlabError(f"{out} holds a study with other settings ({', '.join(changed)}); "
                              "use another --out or the same settings to resume it")
    settings_file.write_text(json.dumps(now, indent=2))
    runs = {name: pretrain(name, st, out) for name in st.models}
    results = {n: downstream(runs, n, st, out) for n in sorted(set(st.per_class))}
    rows = collect(runs, results)
    write_tables(rows, st, out)
    plot_study(rows, out)
    return rows
