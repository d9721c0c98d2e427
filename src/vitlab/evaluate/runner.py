"""Evaluate one model on one data split, with its head and on frozen features, and write the report.

`evaluate_model` is what `vitlab evaluate` and `vitlab compare` both call, so every table uses the
same preprocessing, metrics and labels ("trained head", "zero-shot (mapped ImageNet head)",
"zero-shot (fresh head, chance)", "few-shot ridge", "kNN", "linear probe").
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from vitlab.errors import VitlabError
from vitlab.evaluate import zeroshot as zs
from vitlab.evaluate.features import dataset_labels, run_model
from vitlab.evaluate.metrics import (
    classification_metrics,
    format_report,
    write_confusion_csv,
    write_per_class_csv,
)


@dataclass
class FrozenOptions:
    """Which frozen-feature evaluations to run and their settings (defaults: the paper / DINO)."""

    fewshot: bool = False
    knn: bool = False
    probe: bool = False
    shots: tuple[int, ...] = (1, 5, 10, 25)
    fewshot_seeds: int = 3
    l2_reg: float = 1024.0
    knn_k: int = 20
    knn_temperature: float = 0.07
    max_train_per_class: int | None = None  # cap the training features for kNN / probe (CPU budget)

    @property
    def any(self) -> bool:
        return self.fewshot or self.knn or self.probe


@dataclass
class EvalResult:
    """Everything one evaluation produced; `rows` is the summary table."""

    rows: list[dict] = field(default_factory=list)
    head_metrics: dict | None = None
    head_mode: str = ""
    fewshot: dict | None = None
    knn: dict | None = None
    probe: dict | None = None
    info: dict = field(default_factory=dict)
    labels: list[int] | None = None  # test labels and head predictions, in data-set order (paired tests)
    predictions: list[int] | None = None

    def to_dict(self) -> dict:
        return {"info": self.info, "rows": self.rows, "head_mode": self.head_mode, "head": self.head_metrics,
                "fewshot": self.fewshot, "knn": self.knn, "probe": self.probe}


def _norm(name: str) -> str:
    return str(name).strip().lower()


def choose_head_mode(
    model: nn.Module,
    data_classes: Sequence[str],
    model_classes: Sequence[str] | None,
    zero_shot_map: str | None = None,
    head: str = "auto",
) -> tuple[str, list[list[int]] | None]:
    """('trained' | 'mapped' | 'fresh', class map). 'auto': the model's own head when its classes are the
    data's, a map by class name when the data's classes are a subset of the model's, else a fresh head."""
    n_head = int(model.config.num_classes)
    if zero_shot_map and head in ("fresh", "trained"):  # one of the two was silently ignored
        raise VitlabError(f"--zero-shot-map evaluates through the pretrained head, --head {head} asks for "
                          f"{'a new random head' if head == 'fresh' else 'the head as it is'}; drop one of them")
    if head == "fresh":
        return "fresh", None
    if zero_shot_map:
        if n_head <= 0:
            raise VitlabError("--zero-shot-map needs a model with a classifier head; this one has none")
        head_names = model_classes if model_classes is not None and len(model_classes) == n_head else None
        return "mapped", zs.parse_class_map(zero_shot_map, data_classes, n_head, head_names)
    names = [_norm(c) for c in data_classes]
    by_name = model_classes is not None and len(model_classes) == n_head
    if head == "mapped":  # without a map: by class name, as auto does, when the model's names hold the data's
        if by_name and all(n in [_norm(c) for c in model_classes] for n in names):
            mnames = [_norm(c) for c in model_classes]
            return "mapped", [[mnames.index(n)] for n in names]
        raise VitlabError("a mapped head needs --zero-shot-map CLASS=INDEX,..., e.g. 'Sandal=774,Sneaker=770,Ankle boot=514' "
                          "(or a model whose stored class names include the data's)")
    if by_name:
        mnames = [_norm(c) for c in model_classes]
        if mnames == names:
            return "trained", None
        if sorted(mnames) == sorted(names):  # the same classes in another order: the trained head, reordered
            return "trained", [[mnames.index(n)] for n in names]
        if head != "trained" and all(n in mnames for n in names):
            return "mapped", [[mnames.index(n)] for n in names]
        if head == "trained":
            raise VitlabError(f"the model's classes {list(model_classes)[:5]}... are not the data's {list(data_classes)[:5]}...; "
                              "use --zero-shot-map or a fresh head")
        return "fresh", None
    if n_head == len(names):
        return "trained", None  # no names stored: trust the order
    if head == "trained":
        raise VitlabError(f"the model has {n_head} outputs but the data has {len(names)} classes; "
                          "use --zero-shot-map or a fresh head")
    return "fresh", None


def fresh_head_reason(data_classes: Sequence[str], model_classes: Sequence[str] | None, n_head: int) -> str:
    """Why `auto` gave a trained model a fresh head: said in the row's note, not left to the label alone."""
    if model_classes is None or len(model_classes) != n_head:
        return (f"the model's {n_head} outputs carry no class names and the data has {len(data_classes)} classes; "
                "--zero-shot-map maps them")
    known = {_norm(c) for c in model_classes}
    missing = [c for c in data_classes if _norm(c) not in known]
    return (f"{len(missing)} of the data's {len(data_classes)} classes are not among the model's class names "
            f"({', '.join(map(repr, missing[:3]))}{', ...' if len(missing) > 3 else ''}); --zero-shot-map maps them")


def head_label(mode: str, model: nn.Module) -> str:
    if mode == "trained":
        return zs.LABEL_TRAINED
    if mode == "mapped":
        return zs.mapped_label(int(model.config.num_classes))
    return zs.LABEL_FRESH


def _split(data, split: str):
    ds = getattr(data, split, None)
    if ds is None or len(ds) == 0:
        have = [k for k in ("train", "val", "test") if getattr(data, k, None) is not None and len(getattr(data, k))]
        raise VitlabError(f"the data has no {split!r} split (it has {have}); choose --split from those")
    return ds


def _without_substitutes(train, progress: bool):
    """The training split as frozen-feature evaluations need it: every row its own image. A streamed training split
    replaces an unreadable file by the next readable one (a long run never stops on one bad file), but the few-shot
    sampling, kNN and the probe pair each row's features with the row's own label, so a substitute could enter as
    the wrong class. Its files are decoded once here and the unreadable ones left out, with a note."""
    if not getattr(train, "substitute", False):
        return train
    import sys

    view = train.with_size(train.size)
    view.substitute = False
    kept, bad = view.verify(progress=progress)
    if bad:
        print(f"vitlab: {len(bad)} unreadable training image{'s' * (len(bad) != 1)} left out of the frozen-feature "
              f"evaluations (first: {bad[0][0]}: {bad[0][1]})", file=sys.stderr)
    return kept


def _require_finite(values: np.ndarray | None, what: str) -> None:
    """Refuse NaN / inf model outputs: metrics of them (argmax of NaN is class 0) would look like a result."""
    if values is None or len(values) == 0:
        return
    finite_rows = np.isfinite(values.reshape(len(values), -1)).all(axis=1)
    if not finite_rows.all():
        from vitlab.predict import non_finite_error

        raise non_finite_error(int((~finite_rows).sum()), len(values), what)


def _cap_per_class(labels: np.ndarray, cap: int | None, seed: int = 0) -> np.ndarray | None:
    if cap is None:
        return None
    rng = np.random.default_rng(seed)
    keep = [rng.permutation(np.where(labels == c)[0])[:cap] for c in np.unique(labels)]
    return np.sort(np.concatenate(keep))


def _row(method: str, label: str, m: dict, train_images: int | str = "", note: str = "") -> dict:
    lo, hi = m["accuracy_ci95"]
    return {"method": method, "label": label, "accuracy": m["accuracy"], "ci95_lo": lo, "ci95_hi": hi,
            "macro_f1": m["macro_f1"], "n_test": m["n"], "train_images": train_images, "note": note}


def head_loss(scores: torch.Tensor, labels: Any, mapped: bool = False) -> float:
    """Mean cross-entropy of the head's scores: logits, or for a mapped head its summed probabilities
    renormalised over the data's classes (the loss the validation curves plot)."""
    y = torch.as_tensor(np.asarray(labels)).long()
    if y.numel() == 0:
        return float("nan")
    if mapped:  # float64, as mapped_scores gives them: in float32 (and a 1e-30 floor) tiny probabilities read as loss 0
        s = scores.double()
        logp = torch.log(s.clamp_min(1e-300)) - torch.log(s.sum(dim=1, keepdim=True).clamp_min(1e-300))
        return float(torch.nn.functional.nll_loss(logp, y))
    return float(torch.nn.functional.cross_entropy(scores.float(), y))


def evaluate_model(
    model: nn.Module,
    data,
    preprocess,
    *,
    split: str = "test",
    model_classes: Sequence[str] | None = None,
    zero_shot_map: str | None = None,
    head: str = "auto",
    frozen: FrozenOptions | None = None,
    batch_size: int = 64,
    device: str | None = None,
    seed: int = 0,
    progress: bool = True,
    name: str = "model",
    untrained: bool = False,
    engine=None,
    release: bool = False,
) -> EvalResult:
    """Evaluate `model` on `data.<split>`: its head (trained, mapped or fresh) and, on request,
    few-shot ridge / kNN / linear probe on frozen pre-logits features of `data.train`.

    `release` (a caller that owns `model` and runs nothing else with it, as `vitlab evaluate`): where `engine`
    computes the logits and holds its own weights (ONNX Runtime, OpenVINO), the torch weights are freed before the
    pass; an eager torch engine keeps only its packed copies after its first call (`engine.release.release_model`)."""
    frozen = frozen or FrozenOptions()
    class_names = list(data.class_names)
    k = len(class_names)
    if k < 2:  # every head (restricted to the data's classes, or fresh) says that class: 100 % that says nothing
        raise VitlabError(f"the data has {k} class ({', '.join(map(str, class_names))}): every prediction among its "
                          "classes is right, so an accuracy would say nothing; give at least 2 classes (--classes A,B), "
                          "or see what the model says about these images with `vitlab predict`")
    test = _split(data, split)
    if frozen.any and split == "train":  # kNN scored each training image against itself (its own nearest neighbour)
        raise VitlabError("few-shot, kNN and the linear probe learn from the train split, so scoring them on it tests "
                          "them on their own training images; use --split test (or val), or drop --fewshot/--knn/--probe")
    if untrained:  # a freshly built model: its zero head would always say class 0; a random one is chance
        head = "fresh"
        zero_shot_map = None  # it has no pretrained head to map (compare gives one map to all its models)
    mode, class_map = choose_head_mode(model, class_names, model_classes, zero_shot_map, head)
    result = EvalResult(head_mode=mode, info={"model": name, "split": split, "num_classes": k,
                                               "class_names": class_names, "n_test": len(test)})
    head_model = zs.with_fresh_head(model, k, seed=seed) if mode == "fresh" else model
    # an engine runs the model's own head; a fresh head or frozen-feature analyses need the torch model
    use_engine = engine if mode != "fresh" and not frozen.any else None
    if release and use_engine is not None:
        from vitlab.engine.release import release_model

        release_model(model, use_engine)
    out = run_model(head_model, test, preprocess, batch_size=batch_size, device=device,
                    want_features=frozen.any, progress=progress, desc=f"{name}: {split}", engine=use_engine)
    _require_finite(out.logits, "logits")
    _require_finite(out.features, "features")
    logits = torch.from_numpy(out.logits)
    if mode == "mapped":
        scores = zs.mapped_scores(logits, class_map)
    elif class_map is not None:  # trained head, classes stored in another order
        scores = logits[:, [c[0] for c in class_map]]
    else:
        scores = logits
    pred = scores.argmax(dim=1).numpy()
    m = classification_metrics(out.labels, pred, k, class_names, logits=scores)
    m["loss"] = head_loss(scores, out.labels, mapped=(mode == "mapped"))
    result.head_metrics = m
    result.labels, result.predictions = out.labels.tolist(), pred.tolist()
    label = zs.LABEL_UNTRAINED if untrained else head_label(mode, model)
    if mode == "trained" and not untrained and not model_classes:
        label += zs.LABEL_BY_COUNT  # the row rests on that guess, so its label says it
    note = ""
    if mode == "mapped":
        where = zs.read_class_map(zero_shot_map)[1] if zero_shot_map else "by class name"
        note = f"class map ({where}) {class_map}"
    elif mode == "fresh" and not untrained and head == "auto":
        note = fresh_head_reason(class_names, model_classes, int(getattr(model.config, "num_classes", 0)))
    result.rows.append(_row("head", label, m, note=note))

    if frozen.any:
        from vitlab.evaluate import fewshot as fs

        train = _without_substitutes(_split(data, "train"), progress)
        ytr_all = dataset_labels(train)
        test_x, test_y = out.features, out.labels
        # the backbone is the same whatever the head, so features come from the model as given
        feature_model = model
        tr = None
        if frozen.knn or frozen.probe:  # training features for kNN / probe (all, or capped per class)
            kp_rows = _cap_per_class(ytr_all, frozen.max_train_per_class, seed)
            tr = run_model(feature_model, train, preprocess, batch_size=batch_size, device=device, indices=kp_rows,
                           want_logits=False, want_features=True, progress=progress, desc=f"{name}: train features")
            _require_finite(tr.features, "features")
        if frozen.fewshot:
            need = fs.needed_indices(ytr_all, k, frozen.shots, frozen.fewshot_seeds)
            if tr is not None and (kp_rows is None or np.isin(need, kp_rows).all()):
                fs_x, fs_rows = tr.features, (np.arange(len(ytr_all)) if kp_rows is None else kp_rows)
            else:  # only the rows the sampling uses
                fs_x = run_model(feature_model, train, preprocess, batch_size=batch_size, device=device, indices=need,
                                 want_logits=False, want_features=True, progress=progress,
                                 desc=f"{name}: few-shot features").features
                _require_finite(fs_x, "features")
                fs_rows = need
            res = fs.fewshot_eval(fs_x, ytr_all, test_x, test_y, k, frozen.shots, frozen.fewshot_seeds,
                                  frozen.l2_reg, train_index=fs_rows, progress=progress)
            result.fewshot = res
            counts = np.bincount(ytr_all, minlength=k)
            for r in res["results"]:
                fake = {"accuracy_ci95": [None, None], "accuracy": r["mean"], "macro_f1": None,
                        "n": len(test_y)}
                # the images really used: a class smaller than the shots gives all it has ("incomplete")
                complete = r.get("complete", True)
                note = f"mean of {res['seeds']} seeds, sample std {100 * r['std']:.2f} pp, lambda {res['l2_reg']:g}"
                if not complete:
                    note = (f"incomplete: the smallest class has {int(counts.min())} training images, fewer than "
                            f"{r['shots']}; {note}")
                result.rows.append(_row(f"fewshot-{r['shots']}", f"few-shot ridge, {r['shots']}-shot (frozen"
                                        f"{'' if complete else '; incomplete'})", fake,
                                        train_images=int(np.minimum(counts, r["shots"]).sum()), note=note))
        if tr is not None:
            if frozen.knn:
                from vitlab.evaluate.knn import knn_scores, knn_top5

                ks = knn_scores(tr.features, tr.labels, test_x, k, frozen.knn_k, frozen.knn_temperature,
                                progress=progress)
                mk = classification_metrics(test_y, ks.argmax(1).numpy(), k, class_names)
                used = min(frozen.knn_k, len(tr.labels))  # knn_scores takes every image when there are fewer than k
                if k > 5:  # top-5 where classification_metrics gives one, but DINO's: top-min(5, k), no vote no hit
                    mk["top5"] = knn_top5(ks, test_y, used)
                asked = {} if used == frozen.knn_k else {"k_asked": frozen.knn_k}
                result.knn = {"k": used, **asked, "temperature": frozen.knn_temperature, "n_train": len(tr.labels),
                              **mk}
                result.rows.append(_row("knn", f"kNN k={used} T={frozen.knn_temperature:g} (frozen)", mk,
                                        train_images=len(tr.labels),
                                        note=f"k={used}: all {used} training images (asked for k={frozen.knn_k})"
                                        if asked else ""))
            if frozen.probe:
                from vitlab.evaluate.probe import fit_probe

                val_x = val_y = None
                # C is never chosen on the split the probe is scored on: with --split val it keeps the default
                c_on_eval_split = split == "val"
                if not c_on_eval_split and getattr(data, "val", None) is not None and len(data.val):
                    v = run_model(feature_model, data.val, preprocess, batch_size=batch_size, device=device,
                                  want_logits=False, want_features=True, progress=progress, desc=f"{name}: val features")
                    val_x, val_y = v.features, v.labels
                    _require_finite(val_x, "features")
                probe = fit_probe(tr.features, tr.labels, k, val_x, val_y, seed=seed, progress=progress)
                ps = probe.scores(test_x)
                mp = classification_metrics(test_y, ps.argmax(1), k, class_names, logits=torch.from_numpy(ps))
                chosen_on = ("val" if val_x is not None else
                             "default (the validation split is the one evaluated)" if c_on_eval_split else
                             "default (no validation split)")
                result.probe = {"C": probe.C, "C_chosen_on": chosen_on, "converged": probe.converged,
                                "n_train": len(tr.labels), **mp}
                result.rows.append(_row("probe", "linear probe, logistic regression (frozen)", mp,
                                        train_images=len(tr.labels),
                                        note=f"C={probe.C:g}" + ("" if val_x is not None else f", {chosen_on}")
                                        + ("" if probe.converged else ", not converged (L-BFGS iteration cap)")))
    return result


def _pct(v: Any) -> str:
    return "-" if v is None or (isinstance(v, float) and not np.isfinite(v)) else f"{100 * v:.2f}"


def rows_markdown(rows: Sequence[dict], with_model: bool = False) -> str:
    """The summary rows as a Markdown table (percentages)."""
    head = (["model"] if with_model else []) + ["evaluation", "accuracy %", "95% CI (Wilson)", "macro-F1 %",
                                                 "test images", "train images", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ci = "-" if r["ci95_lo"] is None else f"{_pct(r['ci95_lo'])}-{_pct(r['ci95_hi'])}"
        cells = ([r.get("model", "")] if with_model else []) + [
            r["label"], _pct(r["accuracy"]), ci, _pct(r["macro_f1"]), str(r["n_test"]), str(r["train_images"]), r["note"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _json_default(o: Any):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def write_report(result: EvalResult, out_dir: str | Path, title: str | None = None) -> dict[str, Path]:
    """metrics.json, report.md, summary.csv, confusion_matrix.png/.csv, per_class.csv, fewshot.csv/.png."""
    from vitlab.evaluate.plots import plot_confusion_matrix, plot_fewshot

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    names = result.info["class_names"]
    m = result.head_metrics
    label = result.rows[0]["label"]
    files["metrics"] = out / "metrics.json"
    files["metrics"].write_text(json.dumps(result.to_dict(), indent=2, default=_json_default))
    files["confusion_png"] = plot_confusion_matrix(m["confusion_matrix"], names, out / "confusion_matrix.png",
                                                   title=f"{result.info['model']}: {label}")
    files["confusion_csv"] = write_confusion_csv(m["confusion_matrix"], names, out / "confusion_matrix.csv")
    files["per_class"] = write_per_class_csv(m, out / "per_class.csv")
    files["summary_csv"] = out / "summary.csv"
    with files["summary_csv"].open("w", newline="") as f:
        cols = ["method", "label", "accuracy", "ci95_lo", "ci95_hi", "macro_f1", "n_test", "train_images", "note"]
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in result.rows:
            w.writerow({c: r[c] for c in cols})
    if not result.fewshot:  # an earlier report's few-shot files must not stand beside this one
        for stale in ("fewshot.csv", "fewshot.png"):
            (out / stale).unlink(missing_ok=True)
    else:
        files["fewshot_csv"] = out / "fewshot.csv"
        with files["fewshot_csv"].open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["shots", "seed", "accuracy"])
            for r in result.fewshot["results"]:
                for s, a in enumerate(r["accuracy_per_seed"]):
                    w.writerow([r["shots"], s, f"{a:.6f}"])
        res = result.fewshot["results"]
        files["fewshot_png"] = plot_fewshot(
            {result.info["model"]: ([r["shots"] for r in res], [r["mean"] for r in res], [r["std"] for r in res])},
            out / "fewshot.png", chance=1.0 / len(names),
            incomplete=[r["shots"] for r in res if not r.get("complete", True)])
    md = [f"# {title or 'Evaluation of ' + result.info['model']}", "",
          f"Split `{result.info['split']}`, {result.info['n_test']} images, {len(names)} classes. "
          "Accuracy CIs are 95% Wilson score intervals; few-shot rows are means over seeds (no CI).", "",
          *([f"Engine: {result.info['engine']['name']}.", ""] if result.info.get("engine") else []),
          rows_markdown(result.rows), "", "## Head: per class", "", "```", format_report(m, label), "```", "",
          "Files: confusion_matrix.png / .csv, per_class.csv, summary.csv, metrics.json"
          + (", fewshot.csv / .png" if result.fewshot else "") + "."]
    files["report"] = out / "report.md"
    files["report"].write_text("\n".join(md) + "\n")
    return files
