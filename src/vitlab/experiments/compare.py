"""The comparison people run with this paper: several backbones, each evaluated zero-shot, fine-tuned
with one identical budget, evaluated again; one table, per-epoch curves and runtimes.

For each model: (1) load it (pretrained weights, a vitlab run, or a registry name = from scratch),
(2) zero-shot evaluation on the test split (mapped head with --zero-shot-map, else a fresh untrained
head = chance; a from-scratch model is "untrained"), optionally few-shot / kNN / probe on its frozen
features, (3) fine-tune with `vitlab.train.train` on the same splits, (4) evaluate the fine-tuned
model with the same code and preprocessing. Every model sees the same data, order and settings.
"""

from __future__ import annotations

import csv
import json
import time
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
    """A folder name for a model entry: 'vit-b/16' -> 'vit-b-16', 'custom(dim=32)' -> 'custom-dim-32'."""
    out = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)
    while "--" in out:
        out = out.replace("--", "-")
    return out.strip("-")[:60] or "model"


def _data_side(data) -> int:
    size = data.train.image_size
    return int(size if isinstance(size, int) else max(size))


def _load(ms: ModelSpec, data, st: CompareSettings):
    """(model, preprocess, class_names, source description) for one entry."""
    from vitlab.data import Preprocess
    from vitlab.evaluate.loading import fit_image_size, load_for_eval

    path = ms.weights or (ms.spec if Path(ms.spec).expanduser().exists() else None)
    if path:
        lm = load_for_eval(path, image_size=st.image_size)
        source = "pretrained" if lm.source == "weights" else "vitlab run"
    else:
        size = st.image_size or fit_image_size(ms.spec, _data_side(data))
        lm = load_for_eval(ms.spec, num_classes=data.num_classes, image_size=size,
                           in_chans=data.channels, seed=st.seed)
        source = "from scratch"
    cfg = lm.model.config
    # one preprocessing for every model and both evaluations: plain resize to the model's input, the
    # normalisation the weights were trained with (the fine-tuning's own evaluation transform)
    pre = Preprocess(image_size=cfg.image_size, mean=lm.preprocess.mean, std=lm.preprocess.std,
                     channels=cfg.in_chans)
    return lm, pre, source


def run_compare(
    data,
    models: list[ModelSpec],
    settings: CompareSettings,
    out_dir: str | Path,
    frozen=None,
    data_args: dict | None = None,
) -> dict:
    """Run the whole comparison and write compare.md / .csv / .json, history.csv and three PNGs."""
    from vitlab.evaluate.loading import parse_model_spec
    from vitlab.evaluate.runner import evaluate_model, write_report
    from vitlab.evaluate.zeroshot import LABEL_FINETUNED
    from vitlab.models.registry import count_parameters
    from vitlab.train import resolve_config, train

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    st = settings
    k = data.num_classes
    results = []
    for ms in models:
        if not st.quiet:
            print(f"=== {ms.name} ===", flush=True)
        lm, pre, source = _load(ms, data, st)
        model: nn.Module = lm.model
        mdir = out / _safe(ms.name)
        # ---- zero-shot
        zs = evaluate_model(model, data, pre, split="test", model_classes=lm.class_names,
                            zero_shot_map=st.zero_shot_map, frozen=frozen, batch_size=st.eval_batch_size,
                            device=st.device, seed=st.seed, progress=not st.quiet, name=ms.name,
                            untrained=(source == "from scratch"))
        zs.info["model_description"] = lm.description
        write_report(zs, mdir / "zero-shot", title=f"{ms.name}: before fine-tuning")
        # ---- fine-tune: the paper's zero-initialised head unless the model's own head fits the data
        same_order = lm.class_names is None or [c.lower() for c in lm.class_names] == [
            c.lower() for c in data.class_names]
        keep_head = zs.head_mode == "trained" and source != "from scratch" and same_order
        if not keep_head and hasattr(model, "reset_classifier"):
            model.reset_classifier(k)
        spec_name, spec_args = parse_model_spec(ms.spec)
        overrides = dict(
            data=str((data_args or {}).get("data", data.name)), classes=(data_args or {}).get("classes"),
            per_class=(data_args or {}).get("per_class"), val_fraction=(data_args or {}).get("val_fraction", 0.1),
            model=spec_name if source == "from scratch" else getattr(model.config, "name", ms.spec),
            model_args=spec_args if source == "from scratch" else {},
            weights=ms.weights or (ms.spec if source != "from scratch" else None),
            image_size=int(model.config.image_size[0]), out_dir=str(mdir), name="finetune",
            epochs=st.epochs, steps=0, batch_size=st.batch_size, eval_batch_size=st.eval_batch_size,
            optimizer=st.optimizer, lr=st.lr, weight_decay=st.weight_decay, decay=st.decay,
            warmup_steps=st.warmup_steps, warmup_epochs=0.0, grad_clip=st.grad_clip, label_smoothing=0.0,
            zero_head=not keep_head, mean=list(pre.mean), std=list(pre.std),
            inception_crop=st.augment, hflip=st.augment, precision=st.precision, device=st.device,
            seed=st.seed, quiet=st.quiet, ckpt_every=0, keep_last=1, eval_every=1,
        )
        overrides.update(st.train_overrides)
        cfg = resolve_config("finetune", overrides=overrides)
        t0 = time.perf_counter()
        tr = train(cfg, model=model, data=data)
        train_wall = time.perf_counter() - t0
        ft = evaluate_model(tr.model, data, pre, split="test", model_classes=list(data.class_names),
                            head="trained", batch_size=st.eval_batch_size, device=st.device, seed=st.seed,
                            progress=not st.quiet, name=ms.name)
        ft.rows[0]["label"] = LABEL_FINETUNED
        ft.info["model_description"] = f"{lm.description}, fine-tuned in {tr.run_dir}"
        write_report(ft, mdir / "fine-tuned", title=f"{ms.name}: after fine-tuning")
        results.append({
            "model": ms.name, "spec": ms.spec, "weights": ms.weights, "source": source,
            "description": lm.description, "parameters": count_parameters(tr.model),
            "image_size": list(tr.model.config.image_size),
            "zero_shot": zs.to_dict(), "zero_shot_label": zs.rows[0]["label"],
            "fine_tuned": ft.to_dict(), "history": tr.history, "run_dir": str(tr.run_dir),
            "train_wall_time_s": train_wall, "train_images_per_s": tr.images_per_s,
            "train_test_accuracy": (tr.test_metrics or {}).get("accuracy"),
            "fine_tuned_correct": [int(p == y) for p, y in zip(ft.predictions, ft.labels)],
        })
        if not st.quiet:
            z, f = zs.head_metrics, ft.head_metrics
            print(f"{ms.name}: {zs.rows[0]['label']} {100 * z['accuracy']:.2f}% -> fine-tuned "
                  f"{100 * f['accuracy']:.2f}% ({train_wall:.1f}s)", flush=True)
    summary = {"data": data.summary(), "mcnemar": paired_tests(results), "class_names": list(data.class_names),
               "train_images": len(data.train), "val_images": len(data.val) if data.val is not None else 0,
               "test_images": len(data.test), "settings": {kk: v for kk, v in vars(st).items()},
               "models": results}
    write_outputs(summary, out)
    return summary


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


TABLE_COLS = ["model", "source", "zero-shot evaluation", "zero-shot acc %", "zero-shot 95% CI", "zero-shot macro-F1 %",
              "fine-tuned acc %", "fine-tuned 95% CI", "fine-tuned macro-F1 %", "train images", "epochs",
              "train time s", "parameters"]
CSV_COLS = ["model", "weights", "source", "zero_shot_evaluation", "zero_shot_accuracy", "zero_shot_ci95_lo",
            "zero_shot_ci95_hi", "zero_shot_macro_f1", "fine_tuned_accuracy", "fine_tuned_ci95_lo",
            "fine_tuned_ci95_hi", "fine_tuned_macro_f1", "train_images", "test_images", "epochs",
            "train_time_s", "parameters"]


def table_rows(summary: dict) -> list[dict]:
    rows = []
    for r in summary["models"]:
        z, f = r["zero_shot"]["head"], r["fine_tuned"]["head"]
        rows.append({
            "model": r["model"], "source": r["source"], "zero-shot evaluation": r["zero_shot_label"],
            "zero-shot acc %": 100 * z["accuracy"],
            "zero-shot 95% CI": f"{100 * z['accuracy_ci95'][0]:.2f}-{100 * z['accuracy_ci95'][1]:.2f}",
            "zero-shot macro-F1 %": 100 * z["macro_f1"],
            "fine-tuned acc %": 100 * f["accuracy"],
            "fine-tuned 95% CI": f"{100 * f['accuracy_ci95'][0]:.2f}-{100 * f['accuracy_ci95'][1]:.2f}",
            "fine-tuned macro-F1 %": 100 * f["macro_f1"],
            "train images": summary["train_images"], "epochs": len(r["history"]),
            "train time s": r["train_wall_time_s"], "parameters": r["parameters"],
        })
    return rows


def csv_rows(summary: dict) -> list[dict]:
    """The same table with plain numbers (fractions, not percentages) for scripts."""
    out = []
    for r in summary["models"]:
        z, f = r["zero_shot"]["head"], r["fine_tuned"]["head"]
        out.append({
            "model": r["model"], "weights": r["weights"] or "", "source": r["source"],
            "zero_shot_evaluation": r["zero_shot_label"], "zero_shot_accuracy": z["accuracy"],
            "zero_shot_ci95_lo": z["accuracy_ci95"][0], "zero_shot_ci95_hi": z["accuracy_ci95"][1],
            "zero_shot_macro_f1": z["macro_f1"], "fine_tuned_accuracy": f["accuracy"],
            "fine_tuned_ci95_lo": f["accuracy_ci95"][0], "fine_tuned_ci95_hi": f["accuracy_ci95"][1],
            "fine_tuned_macro_f1": f["macro_f1"], "train_images": summary["train_images"],
            "test_images": summary["test_images"], "epochs": len(r["history"]),
            "train_time_s": r["train_wall_time_s"], "parameters": r["parameters"],
        })
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    if isinstance(v, int) and v > 9999:
        return f"{v:,}"
    return str(v)


def write_outputs(summary: dict, out: Path) -> dict[str, Path]:
    from vitlab.evaluate.plots import plot_bars, plot_lines
    from vitlab.evaluate.runner import _json_default, rows_markdown

    files = {}
    rows = table_rows(summary)
    files["csv"] = out / "compare.csv"
    with files["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLS)
        w.writeheader()
        for r in csv_rows(summary):
            w.writerow({c: (f"{r[c]:.6f}" if isinstance(r[c], float) else r[c]) for c in CSV_COLS})
    files["history"] = out / "history.csv"
    hist_cols = ["model", "epoch", "train_loss", "train_acc", "val_loss", "val_acc", "val_macro_f1", "time_s"]
    with files["history"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=hist_cols)
        w.writeheader()
        for r in summary["models"]:
            for h in r["history"]:
                w.writerow({"model": r["model"], **{c: h.get(c) for c in hist_cols[1:]}})

    def series(key: str, scale: float = 1.0):
        return {r["model"]: ([h["epoch"] for h in r["history"]],
                             [None if h.get(key) is None else scale * float(h[key]) for h in r["history"]])
                for r in summary["models"]}

    files["val_loss"] = plot_lines(series("val_loss"), out / "val_loss.png", "validation loss per epoch",
                                   ylabel="cross-entropy")
    files["val_acc"] = plot_lines(series("val_acc", 100.0), out / "val_accuracy.png",
                                  "validation accuracy per epoch", ylabel="accuracy (%)")
    files["runtime"] = plot_bars({r["model"]: r["train_wall_time_s"] for r in summary["models"]},
                                 out / "runtime.png", "training runtime per model (wall clock)", ylabel="seconds")
    st = summary["settings"]
    md = [
        "# Zero-shot vs fine-tuned", "",
        f"Data: {summary['data']}. Classes: {', '.join(summary['class_names'])}.", "",
        f"Fine-tuning, identical for every model: {st['epochs']:g} epochs, {st['optimizer']} lr {st['lr']:g} "
        f"({st['decay']}, warm-up {st['warmup_steps']} steps), weight decay {st['weight_decay']:g}, batch "
        f"{st['batch_size']}, {'flip + crop augmentation' if st['augment'] else 'no augmentation'}, seed {st['seed']}, "
        f"on {summary['train_images']} training images; zero-shot and fine-tuned accuracy on the same "
        f"{summary['test_images']} test images with the same preprocessing.", "",
        "Zero-shot rows: 'zero-shot (fresh head, chance)' = pretrained backbone + new untrained head (chance by "
        "construction, not transfer); 'zero-shot (mapped ... head)' = the pretrained classifier through a class "
        "map (real zero-shot); 'untrained model (random init, chance)' = a model trained from scratch, before training. "
        "95% CIs: Wilson score intervals. Train time: wall clock of the whole fine-tuning call (training, "
        "per-epoch validation, final test pass) on this machine.", "",
        "| " + " | ".join(TABLE_COLS) + " |", "|" + "---|" * len(TABLE_COLS),
    ]
    for r in rows:
        md.append("| " + " | ".join(_fmt(r[c]) for c in TABLE_COLS) + " |")
    frozen_rows = [dict(row, model=r["model"]) for r in summary["models"] for row in r["zero_shot"]["rows"][1:]]
    if frozen_rows:
        md += ["", "## Frozen features before fine-tuning", "", rows_markdown(frozen_rows, with_model=True)]
    if summary.get("mcnemar"):
        md += ["", "## Fine-tuned models, paired (exact McNemar test on the test images)", "",
               "| model A | model B | only A right | only B right | p-value |", "|---|---|---|---|---|"]
        md += [f"| {t['a']} | {t['b']} | {t['only_a']} | {t['only_b']} | {t['p_value']:.3g} |" for t in summary["mcnemar"]]
    md += ["", "## Per epoch (validation split)", "", "| model | epoch | train loss | val loss | val acc % | val macro-F1 % |",
           "|---|---|---|---|---|---|"]
    for r in summary["models"]:
        for h in r["history"]:
            def p(key, scale=1.0, h=h):
                return "-" if h.get(key) is None else f"{scale * float(h[key]):.4f}" if scale == 1.0 else f"{scale * float(h[key]):.2f}"
            md.append(f"| {r['model']} | {h['epoch']} | {p('train_loss')} | {p('val_loss')} | {p('val_acc', 100.0)} | "
                      f"{p('val_macro_f1', 100.0)} |")
    md += ["", "Figures: val_loss.png, val_accuracy.png, runtime.png. Per model: <model>/zero-shot/ and "
           "<model>/fine-tuned/ (reports, confusion matrices), <model>/finetune/ (the training run)."]
    files["md"] = out / "compare.md"
    files["md"].write_text("\n".join(md) + "\n")
    files["json"] = out / "compare.json"
    files["json"].write_text(json.dumps(summary, indent=2, default=_json_default))
    return files
