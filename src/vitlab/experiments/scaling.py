"""The data-size scaling study (paper Fig. 3/4 at small scale): test accuracy against training-set size.

Every model family is trained from scratch on nested, class-stratified subsets of one training set and
evaluated on the same full test set. What makes the comparison fair (reference/scaling-claims.md §4):

- A validation split is carved out of the training data once (seeded by `seed`, the same for every run)
  before any subset is drawn; it never grows with the size and never overlaps a training subset.
- Subsets are nested within a seed (`nested_order`): the 1,000 images are inside the 3,000, and so on.
  Seed s re-draws the subset order, the initialisation and the data order together.
- One budget rule for every model and size: steps = max(min_steps, ceil(min_epochs * size / batch)).
  Small sets get a floor of optimizer steps (at 1,000 images 5 epochs are 39 steps: no model converges
  in that), large sets get a floor of epochs; the cosine schedule and its warm-up are sized to each
  run's own steps. The test score is the one of the checkpoint with the best validation accuracy
  (early stopping as in the paper's Fig. 4), so the many epochs on a small set cannot hurt by overfitting.
- The same recipe (AdamW, label smoothing, flips, random erasing, 1-pixel shifts) for every model.

Resumable: a finished run (summary.json + scaling.json) is read back, an interrupted one resumes from
its last checkpoint, one killed before its first checkpoint restarts cleanly.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import shutil
import statistics
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from vitlab.errors import VitlabError
from vitlab.experiments.naming import folder_name
from vitlab.experiments.transfer import (
    STUDY_MODELS,
    check_models,
    check_same_data,
    model_config,
    read_settings,
    settings_as_now,
    study_advice,
    study_model,
    write_json,
)

# Settings that only select which runs exist; changing them on an existing study adds or skips runs.
_SELECTION = ("models", "sizes", "seeds", "multi_seed_max", "quiet")

# 97.5 % quantiles of Student's t for 1..30 degrees of freedom (scipy is a test dependency only).
_T975 = [12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157,
         2.228139, 2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922,
         2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831,
         2.048407, 2.045230, 2.042272]


@dataclass
class ScalingSettings:
    data: str = "fashion-mnist"
    models: list[str] = field(default_factory=lambda: ["vit", "hybrid", "resnet26"])
    sizes: list[int] = field(default_factory=lambda: [1000, 3000, 10000, 30000, 60000])
    seeds: int = 3  # seeds at sizes <= multi_seed_max; one above
    multi_seed_max: int = 10000
    seed: int = 0  # the validation split's seed and the first run seed
    val_fraction: float = 0.1
    # the budget rule: steps = max(min_steps, ceil(min_epochs * size / batch_size))
    min_epochs: float = 5.0
    min_steps: int = 500
    batch_size: int = 128
    lr: float = 2e-3
    warmup_fraction: float = 0.05
    weight_decay: float = 0.05
    label_smoothing: float = 0.1
    evals: int = 8  # validation passes per run (at most; plus the last epoch)
    threads: int | None = None  # every run's CPU threads; None: decided once at the study's start, then recorded
    device: str = "auto"  # every run's device (auto: the GPU where there is one)
    quiet: bool = False


def t_quantile(df: int) -> float:
    from vitlab.evaluate.metrics import Z95

    if 1 <= df <= len(_T975):
        return _T975[df - 1]
    if df < 1:
        return Z95
    # beyond the table: the Cornish-Fisher expansion of Student's t in the normal quantile (Abramowitz & Stegun
    # 26.7.5), within 1e-6 of scipy's t.ppf from 31 degrees of freedom on; the normal's 1.96 was 0.08 short at 31
    z = Z95
    terms = ((z**3 + z) / 4, (5 * z**5 + 16 * z**3 + 3 * z) / 96, (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
             (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160)
    return z + sum(g / df ** (i + 1) for i, g in enumerate(terms))


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, lo, hi): the 95 % t-interval of the mean over seeds (two or more values), clipped to [0, 1]
    (with two seeds t = 12.7 makes it wider than the scale)."""
    m = statistics.fmean(values)
    half = t_quantile(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return m, max(0.0, m - half), min(1.0, m + half)


def run_steps(size: int, st: ScalingSettings) -> int:
    """The budget rule (module docstring): a floor of steps for small sets, of epochs for large ones."""
    return max(st.min_steps, math.ceil(st.min_epochs * size / st.batch_size))


def plan(st: ScalingSettings, available: int) -> list[dict]:
    """One entry per distinct training size: requested size(s), the size used, capped or not, run seeds."""
    out: dict[int, dict] = {}
    for req in st.sizes:
        n = min(req, available)
        entry = out.setdefault(n, {"size": n, "requested": [], "capped": False})
        entry["requested"].append(req)
        entry["capped"] |= req > available
    for entry in out.values():
        k = st.seeds if entry["size"] <= st.multi_seed_max else 1
        entry["seeds"] = [st.seed + i for i in range(k)]
    return [out[n] for n in sorted(out)]


def _check(st: ScalingSettings, out: Path) -> tuple[ScalingSettings, dict, dict, str]:
    """Refuse bad values and changed settings; (the settings with the thread count decided, the record for
    settings.json once the study can start, the earlier record, why that thread count)."""
    check_models(st.models, "vit,hybrid,resnet26")
    from vitlab.runtime import resolve_device

    resolve_device(st.device)  # --device cuda without a GPU: one line before the study folder exists
    if not st.sizes or any(n < 1 for n in st.sizes):
        raise VitlabError(f"--sizes must be positive whole numbers, got {st.sizes}")
    if st.seeds < 1 or st.min_steps < 1 or st.min_epochs < 0 or st.evals < 1 or st.batch_size < 1:
        raise VitlabError("--seeds, --min-steps, --evals and --batch-size must be >= 1 and --min-epochs >= 0")
    if not 0 < st.val_fraction < 1:
        raise VitlabError(f"--val-fraction must be between 0 and 1, got {st.val_fraction}")
    from vitlab.data.load import absolute_source

    # recorded (settings.json) and given to every run as the absolute path: the same study from another folder
    st = replace(st, data=absolute_source(st.data))
    before = settings_as_now(read_settings(out), st.data)
    from vitlab.runtime import study_threads

    threads, why = study_threads(st.threads, before.get("threads"))
    st = replace(st, threads=threads)
    now = {k: v for k, v in asdict(st).items() if k != "quiet"}
    changed = sorted(k for k in now if k in before and before[k] != now[k] and k not in _SELECTION)
    if changed:
        raise VitlabError(f"{out} holds a scaling study with other settings ({', '.join(changed)}); "
                          "use another --out or the same settings to resume it")
    return st, now, before, why


def _train_overrides(name: str, size: int, seed: int, st: ScalingSettings, run: Path, steps_per_epoch: int) -> dict:
    spec, args, image_size = study_model(name)
    steps = run_steps(size, st)
    epochs = math.ceil(steps / steps_per_epoch)
    # a validation pass over the fixed split costs about a third of a training epoch on it: cap their number
    return dict(
        data=st.data, model=spec, model_args=args, image_size=image_size, threads=st.threads, device=st.device,
        out_dir=str(run.parent), name=run.name, steps=steps,
        batch_size=st.batch_size, lr=st.lr, warmup_steps=max(1, round(st.warmup_fraction * steps)),
        weight_decay=st.weight_decay, label_smoothing=st.label_smoothing, inception_crop=False,
        random_erasing=0.25, random_shift=1, seed=seed, quiet=True, ckpt_every=200,
        eval_every=max(1, math.ceil(epochs / st.evals)), val_fraction=st.val_fraction,
        data_seed=st.seed,  # the study split the data with its seed; `seed` varies the run's initialisation
    )


def _subset_data(data, size: int, seed: int):
    from vitlab.data.dataset import DataSplits
    from vitlab.data.splits import nested_subset

    train = data.train.subset(nested_subset(data.train.labels.numpy(), size, seed))
    return DataSplits(train, data.val, data.test, list(data.class_names), list(data.skipped), data.name,
                      data.channels, list(data.notes))


def train_run(name: str, size: int, seed: int, data, st: ScalingSettings, run: Path) -> None:
    """Train one (model, size, seed); resume an interrupted run, restart one that left no checkpoint."""
    from vitlab.train import resolve_config, train
    from vitlab.train.checkpoint import CheckpointManager

    steps_per_epoch = max(1, size // st.batch_size)
    overrides = _train_overrides(name, size, seed, st, run, steps_per_epoch)
    # the rule `--resume RUN` picks its checkpoint by: a stray file named like one is no checkpoint
    if CheckpointManager(run / "checkpoints").latest() is not None:
        overrides["resume"] = str(run)
    elif run.exists():  # killed before its first checkpoint: nothing to keep, and stale metrics would mislead
        shutil.rmtree(run)
    cfg = resolve_config("small-data", overrides=overrides)
    with study_advice(run, "--lr"):
        if st.quiet:  # the training's own lines go to the run folder instead of the terminal
            run.mkdir(parents=True, exist_ok=True)
            with (run / "train.log").open("a") as log, contextlib.redirect_stdout(log):
                train(cfg, data=_subset_data(data, size, seed))
        else:
            train(cfg, data=_subset_data(data, size, seed))


def selected_metrics(run: Path, data) -> dict:
    """Test metrics of the best-validation checkpoint (the final model's when that was the best)."""
    summary = json.loads((run / "summary.json").read_text())
    tm, picked, best_val, best_epoch = summary["test_metrics"], "final", summary.get("best_val_acc"), None
    best = run / "checkpoints" / "best.pt"
    if best.exists():
        from vitlab.train.checkpoint import load_checkpoint

        state = load_checkpoint(best)
        best_epoch, best_val = state.get("epoch"), state.get("best_metric", best_val)
        if state.get("global_step") != summary["steps"]:
            tm, picked = _test_metrics(run, state["model"], data, summary), "best-val"
    return {"test_accuracy": tm["accuracy"], "test_ci95": list(tm["accuracy_ci95"]), "test_n": tm["n"],
            "test_macro_f1": tm["macro_f1"], "final_test_accuracy": summary["test_accuracy"],
            "selected": picked, "best_val_acc": best_val, "best_epoch": best_epoch, "epochs": summary["epochs"],
            "steps": summary["steps"], "parameters": summary["parameters"],
            "train_wall_time_s": summary["wall_time_s"], "threads": summary.get("torch_threads"),
            # `auto` (the recipe's) decides per model: bf16-stem for the conv-stem hybrid on a CPU with fast
            # bf16, fp32 for the others; the report says so instead of calling the recipe the same for all
            "precision": summary.get("precision")}


def _test_metrics(run: Path, state_dict: dict, data, summary: dict) -> dict:
    import torch

    from vitlab.data.transforms import build_eval_transform
    from vitlab.train.distributed import DistInfo
    from vitlab.train.evaluation import predict_split, split_metrics
    from vitlab.weights import load_with_meta

    model, meta = load_with_meta(run / "model")
    model.load_state_dict(state_dict)
    device = torch.device(summary["device"])
    eval_tf = build_eval_transform(meta["preprocess"]).to(device)
    logits, labels = predict_split(model.to(device), data.test, eval_tf, device, summary["precision"], 500,
                                   DistInfo())
    return split_metrics(logits, labels, list(data.class_names))


def one_run(name: str, size: int, seed: int, data, st: ScalingSettings, out: Path) -> dict:
    """Train (or resume, or read back) one run and return its row of results (also written to scaling.json)."""
    run = out / "runs" / f"{folder_name(name)}-n{size}-s{seed}"
    done = run / "scaling.json"
    try:
        stored = json.loads(done.read_text()) if done.exists() else None
    except (OSError, ValueError):  # cut off by a kill (before rows were written whole): made again below
        stored = None
    if isinstance(stored, dict):
        row = dict(stored, reused=True)
        if "precision" not in row:  # a row written before it recorded the precision: the run's summary has it
            with contextlib.suppress(OSError, ValueError):
                row["precision"] = json.loads((run / "summary.json").read_text()).get("precision")
        return row
    if not (run / "summary.json").exists():
        train_run(name, size, seed, data, st, run)
    t0 = time.perf_counter()
    row = {"model": name, "size": size, "seed": seed, "run": str(run.relative_to(out)),
           "steps_rule": run_steps(size, st), **selected_metrics(run, data)}
    row["images_seen"] = row["steps"] * st.batch_size
    # the training process's own time (from summary.json, so a run trained before a kill counts too; a
    # resumed run counts its last segment) plus the best-checkpoint test pass
    row["wall_time_s"] = row["train_wall_time_s"] + time.perf_counter() - t0
    write_json(done, row)
    return row


def aggregate(runs: list[dict], entry: dict, facts: dict) -> dict:
    """One table row per (model, size): mean over seeds, a Wilson CI (one seed) or a t-interval (several)."""
    accs = [r["test_accuracy"] for r in runs]
    f1s = [r["test_macro_f1"] for r in runs]
    row: dict[str, Any] = {
        "model": runs[0]["model"], **facts, "size": entry["size"],
        "requested_size": ",".join(str(n) for n in entry["requested"]), "capped": entry["capped"],
        "seeds": len(runs), "steps": runs[0]["steps"], "images_seen": runs[0]["images_seen"],
        "epochs": runs[0]["steps"] * facts["batch_size"] / entry["size"],
        "test_accuracy": statistics.fmean(accs), "test_macro_f1": statistics.fmean(f1s),
        "best_val_acc": statistics.fmean(r["best_val_acc"] for r in runs if r["best_val_acc"] is not None)
        if any(r["best_val_acc"] is not None for r in runs) else None,
        "wall_time_s": statistics.fmean(r["wall_time_s"] for r in runs),
        "seed_accuracies": accs,
        "precision": ",".join(sorted({str(r.get("precision")) for r in runs if r.get("precision")})) or None,
    }
    if len(runs) == 1:
        row.update(test_accuracy_ci95=runs[0]["test_ci95"], ci_method="wilson", test_accuracy_sd=None,
                   test_macro_f1_ci95=None)
    else:
        _, lo, hi = mean_interval(accs)
        _, flo, fhi = mean_interval(f1s)
        row.update(test_accuracy_ci95=[lo, hi], ci_method=f"t, {len(runs)} seeds",
                   test_accuracy_sd=statistics.stdev(accs), test_macro_f1_ci95=[flo, fhi])
    return row


def model_facts(name: str, data, st: ScalingSettings) -> dict:
    """Parameters and MACs per image of a model at the data's shape (also checks the name before training)."""
    from vitlab.models.registry import analytic_macs, build_model, count_parameters

    spec, args, size = study_model(name)
    cfg = model_config(name, data.num_classes, data.train.image_size[0], data.channels)
    shown = {**args, "image_size": size} if size else args
    desc = spec + (f"({', '.join(f'{k}={v}' for k, v in shown.items())})" if shown else "")
    return {"spec": desc, "parameters": count_parameters(build_model(cfg)), "mmacs": analytic_macs(cfg) / 1e6,
            "batch_size": st.batch_size}


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


def _ci(v: list[float] | None) -> str:
    return "-" if not v else f"{100 * v[0]:.1f}-{100 * v[1]:.1f}"


def _size_cell(r: dict, val_size: int) -> str:
    if not r["capped"]:
        return f"{r['size']:,}"
    return f"{r['size']:,} (asked {r['requested_size']}: all remaining after the {val_size:,}-image validation split)"


def _precision_line(rows: list[dict]) -> str:
    """The training precision the runs used: one for all, or each model's (the recipe's `auto` chooses per model
    from its architecture and this CPU's bf16 speed, so "the same recipe" did not mean the same numerics)."""
    per_model: dict[str, set[str]] = {}
    for r in rows:
        per_model.setdefault(r["model"], set()).update(p for p in (r.get("precision") or "").split(",") if p)
    used = {p for ps in per_model.values() for p in ps}
    if not used:
        return ""
    if len(used) == 1:
        return f"Training precision: {next(iter(used))} for every run."
    return ("Training precision, **not the same for every model** (the recipe's `auto` chose it per model: bf16 "
            "where this CPU computes it fast and the model gains from it): "
            + "; ".join(f"{m} {', '.join(sorted(ps)) or '?'}" for m, ps in per_model.items()) + ".")


def _threads_line(runs: list[dict], st: ScalingSettings) -> str:
    """The thread count that reproduces the numbers (other counts give other bits), and any run that used another."""
    line = (f"CPU threads: {st.threads} for every run (decided at the study's start and recorded in settings.json; "
            "a rerun uses it; the same count reproduces these numbers).")
    other = sorted({r["threads"] for r in runs if r.get("threads") not in (None, st.threads)})
    if other:
        n = sum(r.get("threads") in other for r in runs)
        line += (f" {n} run{'s' if n != 1 else ''} reused from before the count was recorded ran with "
                 f"{', '.join(map(str, other))} threads.")
    return line


COLUMNS = ["model", "spec", "parameters", "mmacs", "size", "requested_size", "capped", "seeds", "steps", "epochs",
           "images_seen", "test_accuracy", "test_accuracy_ci95", "ci_method", "test_accuracy_sd", "test_macro_f1",
           "test_macro_f1_ci95", "best_val_acc", "wall_time_s", "seed_accuracies", "precision"]


def write_tables(rows: list[dict], runs: list[dict], st: ScalingSettings, info: dict, out: Path) -> Path:
    with (out / "study.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in COLUMNS})
    (out / "study.json").write_text(json.dumps({"settings": asdict(st), "data": info, "rows": rows, "runs": runs},
                                               indent=2))
    md = [
        "# Scaling study: test accuracy against training-set size, every model trained from scratch", "",
        f"Data: {st.data}. Validation: {info['val_images']:,} images carved out of the training split before "
        f"subsetting (seed {st.seed}), the same for every run. Training subsets: nested and class-stratified "
        f"(each smaller one inside each larger one, per seed), from {info['train_pool']:,} remaining images. "
        f"Test: the full test split ({info['test_images']:,} images), the same for every run.", "",
        *([f"**Data notes** (from loading): {'; '.join(info['notes'])}.", ""] if info.get("notes") else []),
        f"Budget, one rule for every model and size: steps = max({st.min_steps}, ceil({st.min_epochs:g} epochs x "
        f"size / batch {st.batch_size})), images seen = steps x {st.batch_size}, epochs = images seen / size (a "
        "run's log counts its own epochs of whole batches, the last partial batch left out, so it may say more); "
        f"AdamW lr {st.lr:g}, cosine with "
        f"{100 * st.warmup_fraction:g} % warm-up sized to each run, weight decay {st.weight_decay:g}, label "
        f"smoothing {st.label_smoothing:g}, flip + random erasing + 1-pixel shift. Test numbers are those of the "
        f"checkpoint with the best validation accuracy (about {st.evals} validation "
        f"pass{'es' if st.evals != 1 else ''} per run).", "",
        f"Seeds: {st.seeds} at sizes up to {st.multi_seed_max:,} (subset order, initialisation and data order "
        "re-drawn together), one above. 95 % CI: Wilson for one seed, Student's t over the seeds' accuracies for "
        "several (the seeds' spread, not the test set's sampling error); sd = the seeds' standard deviation. "
        "Accuracy and macro-F1 in %, means over the seeds.", "",
        _threads_line(runs, st) + (f" {_precision_line(rows)}" if _precision_line(rows) else ""), "",
        "| model | parameters | MMACs/image | training images | seeds | steps | epochs | images seen | test acc % "
        "| 95 % CI | CI | sd | macro-F1 % | best val acc % | s/run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sd = "-" if r["test_accuracy_sd"] is None else f"{100 * r['test_accuracy_sd']:.2f}"
        md.append(
            f"| {r['model']} | {r['parameters']:,} | {r['mmacs']:.1f} | {_size_cell(r, info['val_images'])} | "
            f"{r['seeds']} | {r['steps']:,} | {r['epochs']:.1f} | {r['images_seen']:,} | {_pct(r['test_accuracy'])} | "
            f"{_ci(r['test_accuracy_ci95'])} | {r['ci_method']} | {sd} | {_pct(r['test_macro_f1'])} | "
            f"{_pct(r['best_val_acc'])} | {r['wall_time_s']:.0f} |")
    named = [f"{m} = {s}" for m, s in dict.fromkeys((r["model"], r["spec"]) for r in rows) if m in STUDY_MODELS]
    if named:
        md += ["", "Models: " + "; ".join(named) + "."]
    md += ["", "Figure: study.png. One run folder per model, size and seed: runs/ (config, metrics.jsonl, "
           "checkpoints incl. best.pt, summary.json, scaling.json = the row of that run)."]
    path = out / "study.md"
    path.write_text("\n".join(md) + "\n")
    return path


def plot_study(rows: list[dict], runs: list[dict], out: Path) -> Path:
    """Test accuracy against training-set size (log x), one line per model, CI band, seeds as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, name in enumerate(dict.fromkeys(r["model"] for r in rows)):
        pts = [r for r in rows if r["model"] == name]
        xs = [r["size"] for r in pts]
        color = f"C{i}"
        label = "\n".join(textwrap.wrap(name, 36))  # long registry specs would squeeze the axes
        ax.plot(xs, [100 * r["test_accuracy"] for r in pts], "o-", color=color, label=label)
        ax.fill_between(xs, [100 * r["test_accuracy_ci95"][0] for r in pts],
                        [100 * r["test_accuracy_ci95"][1] for r in pts], color=color, alpha=0.15)
        seeds = [r for r in runs if r["model"] == name]
        ax.plot([r["size"] for r in seeds], [100 * r["test_accuracy"] for r in seeds], ".", color=color, alpha=0.5)
    ax.set_xscale("log")
    sizes = sorted({r["size"] for r in rows})
    ax.xaxis.set_major_locator(FixedLocator(sizes))  # tick the sizes that were run, in plain numbers
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(sizes, [f"{n:,}" for n in sizes], rotation=30 if len(sizes) > 4 else 0)
    ax.set_xlabel("training images (log scale)")
    tested = sorted({r["test_n"] for r in runs if r.get("test_n")})  # the same test split for every run
    ax.set_ylabel("test accuracy (%)" + (f" on {', '.join(f'{n:,}' for n in tested)} test images" if tested else ""))
    ax.set_title("From scratch on nested subsets: test accuracy vs data size", fontsize=11)
    ax.grid(alpha=0.3, which="major")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False,
              title="mean, 95 % CI band;\ndots: single seeds", title_fontsize=8)
    path = out / "study.png"
    fig.savefig(path, dpi=130, bbox_inches="tight")  # "tight" widens the canvas for the outside legend
    plt.close(fig)
    return path


def _progress(i: int, total: int, row: dict) -> str:
    state = "done before" if row.get("reused") else f"{row['wall_time_s']:.0f}s"
    return (f"[{i}/{total}] {row['model']} size {row['size']:,} seed {row['seed']}: test acc "
            f"{100 * row['test_accuracy']:.2f} % (F1 {100 * row['test_macro_f1']:.2f} %, {row['selected']} "
            f"checkpoint, val {_pct(row['best_val_acc'])} %), {row['steps']} steps, {state}")


def run_scaling_study(st: ScalingSettings, out_dir: str | Path) -> list[dict]:
    """Train every model at every size and seed (resuming), write study.md/.csv/.json and study.png."""
    import torch

    from vitlab.data import load_data

    out = Path(out_dir)
    st, now, before, why = _check(st, out)  # bad values fail before the folder exists
    data = load_data(st.data, val_fraction=st.val_fraction, seed=st.seed, progress=not st.quiet, report=True)
    if data.val is None or data.test is None:
        raise VitlabError(f"{st.data} gave no validation or test split; the study needs both")
    if data.num_classes < 2:  # one class: every prediction is right, 100 % says nothing
        raise VitlabError(f"{st.data} has one class ({data.class_names[0]}); the study needs at least 2")
    # runs finished on other data must not stand beside new ones (nor the test-set size be misreported)
    now["data_identity"] = data.identity()
    check_same_data(before, now["data_identity"], out)
    from vitlab.experiments.compare import data_fingerprint

    now["data_files"] = data_fingerprint(data)
    if before.get("data_files") not in (None, now["data_files"]):  # None: a study made before it was recorded
        raise VitlabError(f"{out} holds a study made on other files of {st.data} (a photo added, removed, renamed, "
                          "replaced or moved to another class since, with every split's size the same); use another "
                          "--out, or the data as it was to resume it")
    entries = plan(st, len(data.train))
    if entries[0]["size"] < st.batch_size:
        raise VitlabError(f"size {entries[0]['size']} is smaller than --batch-size {st.batch_size}; "
                          "use larger sizes or a smaller batch")
    facts = {name: model_facts(name, data, st) for name in st.models}
    # written only now: a typo in --data or --models must not lock the folder to the wrong settings (nor
    # leave an empty folder)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "settings.json", now)
    print(f"vitlab study scaling: {st.threads} CPU threads for every run ({why}; recorded in settings.json)",
          file=sys.stderr, flush=True)
    torch.set_num_threads(st.threads)  # the best-checkpoint test passes run in this process
    from vitlab.experiments.compare import data_notes

    info = {"train_pool": len(data.train), "val_images": len(data.val), "test_images": len(data.test),
            "notes": data_notes(data)}
    # size-major: an interrupted study has every model at the sizes it reached (a usable partial table)
    jobs = [(name, e, s) for e in entries for s in e["seeds"] for name in st.models]
    for e in entries:
        if e["capped"]:
            sizes = e["requested"]  # several requested sizes can be capped to the one size there is
            print(f"vitlab study scaling: size{'s' if len(sizes) > 1 else ''} {', '.join(map(str, sizes))} "
                  f"{'are' if len(sizes) > 1 else 'is'} more than the "
                  f"{len(data.train):,} training images left after the validation split; using all of them",
                  file=sys.stderr)
    runs = []
    for i, (name, entry, seed) in enumerate(jobs, 1):
        if not st.quiet:
            print(f"=== [{i}/{len(jobs)}] {name}, {entry['size']:,} images, seed {seed} ===", flush=True)
        row = one_run(name, entry["size"], seed, data, st, out)
        print(_progress(i, len(jobs), row), flush=True)
        runs.append(row)
    rows = []
    for name in st.models:
        for e in entries:
            mine = [r for r in runs if r["model"] == name and r["size"] == e["size"]]
            rows.append(aggregate(mine, e, facts[name]))
    write_tables(rows, runs, st, info, out)
    plot_study(rows, runs, out)
    return rows
