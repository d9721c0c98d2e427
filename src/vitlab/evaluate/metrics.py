"""Classification metrics from labels and predictions: accuracy with a 95% CI, top-5, macro-F1, per class.

Everything derives from one confusion matrix (rows = true class, columns = predicted), counted with
`torch.bincount`; that is a one-liner, so no library is needed for it. Definitions follow
scikit-learn (precision/recall/F1 of a class with no predictions/no support are 0, as its
`zero_division=0`), and the tests check them against scikit-learn. The macro averages are over the classes
present in the labels or the predictions, as scikit-learn's default (`labels=None`): a class with no test image
that is never predicted says nothing about the model, and counting it as F1 0 lowered macro-F1 without a word
(such classes are listed in `absent_classes`).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitlab.errors import VitlabError

Z95 = 1.959963984540054  # the 97.5% quantile of the standard normal


def _as_long(values: Any, name: str) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(values) if not isinstance(values, torch.Tensor) else values)
    t = t.detach().cpu().reshape(-1)
    if t.is_floating_point():
        if not torch.equal(t, t.round()):
            raise VitlabError(f"{name} must be integer class indices, got floating-point values")
    return t.long()


def confusion_matrix(y_true: Any, y_pred: Any, num_classes: int) -> torch.Tensor:
    """(K, K) int64 counts; entry [i, j] = examples of true class i predicted as class j."""
    t, p = _as_long(y_true, "y_true"), _as_long(y_pred, "y_pred")
    if t.numel() != p.numel():
        raise VitlabError(f"y_true has {t.numel()} entries but y_pred has {p.numel()}; pass one prediction per label")
    for name, v in (("y_true", t), ("y_pred", p)):
        if v.numel() and (int(v.min()) < 0 or int(v.max()) >= num_classes):
            raise VitlabError(
                f"{name} holds class index {int(v.max()) if int(v.max()) >= num_classes else int(v.min())} "
                f"outside 0..{num_classes - 1}; check num_classes"
            )
    return torch.bincount(t * num_classes + p, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a proportion (stays inside [0, 1] and is sensible at p = 0 or 1).

    Chosen over the normal approximation p +- z*sqrt(p(1-p)/n), which collapses to zero width at
    p = 1 and can leave [0, 1] on small test sets; for large n the two agree.
    """
    if n <= 0:
        return (float("nan"), float("nan"))
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def normal_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The normal-approximation (Wald) interval p +- z*sqrt(p(1-p)/n), clipped to [0, 1]."""
    if n <= 0:
        return (float("nan"), float("nan"))
    p = correct / n
    half = z * math.sqrt(p * (1 - p) / n)
    return (max(0.0, p - half), min(1.0, p + half))


def topk_accuracy(logits: Any, y_true: Any, k: int) -> float:
    """Fraction of examples whose true class is among the k highest logits (ties: lower class index first)."""
    lg = torch.as_tensor(logits).detach().cpu().double()  # float32 would turn tiny float64 scores into ties at 0
    t = _as_long(y_true, "y_true")
    k = min(k, lg.shape[1])
    # Ties (tied logits, probabilities that underflow to 0, kNN classes without a neighbour) are broken like argmax,
    # lower class index first: torch.topk breaks them arbitrarily, so an example right at top-1 could be missing
    # from its own top 5. (scikit-learn's top_k_accuracy_score prefers the higher index; without ties they agree.)
    top = lg.sort(dim=1, descending=True, stable=True).indices[:, :k]
    return float((top == t[:, None]).any(dim=1).double().mean()) if t.numel() else float("nan")


def _safe_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(b > 0, a / b.clamp(min=1e-12), torch.zeros_like(a))


def classification_metrics(
    y_true: Any,
    y_pred: Any,
    num_classes: int,
    class_names: Sequence[str] | None = None,
    logits: Any = None,
) -> dict[str, Any]:
    """All the numbers of a classification report, JSON-serialisable.

    Returns `n`, `accuracy`, `accuracy_ci95` (Wilson, (lo, hi)), `ci_method`, `macro_f1`,
    `macro_precision`, `macro_recall`, `weighted_f1`, `top5` (only with `logits` and more than
    5 classes), `per_class` (list of dicts: name, precision, recall, f1, support) and
    `confusion_matrix` (list of lists, rows = true class).
    """
    if class_names is None:
        class_names = [str(i) for i in range(num_classes)]
    if len(class_names) != num_classes:
        raise VitlabError(f"got {len(class_names)} class names for {num_classes} classes; pass one name per class")
    cm = confusion_matrix(y_true, y_pred, num_classes)
    n = int(cm.sum())
    correct = int(cm.diag().sum())
    cmf = cm.double()
    tp = cmf.diag()
    support = cmf.sum(dim=1)
    predicted = cmf.sum(dim=0)
    precision = _safe_div(tp, predicted)
    recall = _safe_div(tp, support)
    f1 = _safe_div(2 * precision * recall, precision + recall)
    present = (support > 0) | (predicted > 0)
    macro = present if bool(present.any()) else torch.ones_like(present)
    out: dict[str, Any] = {
        "n": n,
        "num_classes": num_classes,
        "accuracy": correct / n if n else float("nan"),
        "accuracy_ci95": list(wilson_interval(correct, n)),
        "ci_method": "wilson",
        "macro_f1": float(f1[macro].mean()),
        "macro_precision": float(precision[macro].mean()),
        "macro_recall": float(recall[macro].mean()),
        # classes left out of the macro averages: no test image and never predicted
        "absent_classes": [str(class_names[k]) for k in range(num_classes) if not present[k]],
        "weighted_f1": float((f1 * support).sum() / n) if n else float("nan"),
    }
    if logits is not None and num_classes > 5:
        out["top5"] = topk_accuracy(logits, y_true, 5)
    out["per_class"] = [
        {"name": str(class_names[k]), "precision": float(precision[k]), "recall": float(recall[k]),
         "f1": float(f1[k]), "support": int(support[k])}
        for k in range(num_classes)
    ]
    out["confusion_matrix"] = cm.tolist()
    return out


def binom_two_sided_half(k: int, n: int) -> float:
    """Exact two-sided binomial p-value at p = 1/2: min(1, 2 * P[X <= min(k, n - k)]), X ~ Bin(n, 1/2).

    Summed in log space (math.lgamma, terms scaled by the largest): the direct sum of C(n, i) / 2^n overflows a float
    once n passes ~1023. Hand-written because scipy is not a runtime dependency; the tests check it
    against `scipy.stats.binomtest`.
    """
    if n <= 0:
        return 1.0
    m = min(k, n - k)
    if 2 * m >= n:  # k = n/2: the two tails cover everything
        return 1.0
    # log C(n, m) once, then the lower terms relative to it: C(n, i-1) / C(n, i) = i / (n - i + 1) < 1,
    # so the relative terms only shrink and the sum stops once they no longer change it
    log_top = math.lgamma(n + 1) - math.lgamma(m + 1) - math.lgamma(n - m + 1)
    total, term = 1.0, 1.0
    for i in range(m, 0, -1):
        term *= i / (n - i + 1)
        if term < 1e-18 * total:
            break
        total += term
    log_tail = log_top + math.log(total) - n * math.log(2.0)
    return min(1.0, 2.0 * math.exp(log_tail))


def mcnemar(correct_a: Any, correct_b: Any) -> dict[str, Any]:
    """Exact McNemar test of two classifiers on the same examples (two-sided binomial on the discordant pairs).

    b = examples only A gets right, c = only B gets right; p = min(1, 2 P[X <= min(b, c)]), X ~ Bin(b + c, 1/2).
    """
    a = np.asarray(correct_a, bool).reshape(-1)
    b_ = np.asarray(correct_b, bool).reshape(-1)
    if a.shape != b_.shape:
        raise VitlabError("McNemar needs the two models' results on the same examples")
    b = int((a & ~b_).sum())
    c = int((~a & b_).sum())
    return {"only_a": b, "only_b": c, "p_value": binom_two_sided_half(b, b + c)}


def write_confusion_csv(cm: Sequence[Sequence[int]], class_names: Sequence[str], path: str | Path) -> Path:
    """The confusion matrix as CSV: a header of predicted classes, one row per true class."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["true \\ predicted", *class_names])
        for name, row in zip(class_names, cm):
            w.writerow([name, *[int(v) for v in row]])
    return path


def write_per_class_csv(metrics: dict[str, Any], path: str | Path) -> Path:
    """Per-class precision, recall, F1 and support as CSV."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["class", "precision", "recall", "f1", "support"])
        for row in metrics["per_class"]:
            w.writerow([row["name"], f"{row['precision']:.6f}", f"{row['recall']:.6f}", f"{row['f1']:.6f}", row["support"]])
    return path


def format_report(metrics: dict[str, Any], title: str | None = None) -> str:
    """A short plain-text report: headline numbers and the per-class table."""
    lo, hi = metrics["accuracy_ci95"]
    lines = [title] if title else []
    lines.append(
        f"accuracy {100 * metrics['accuracy']:.2f}% (95% CI {100 * lo:.2f}-{100 * hi:.2f}, {metrics['ci_method']}, "
        f"n={metrics['n']})   macro-F1 {100 * metrics['macro_f1']:.2f}%"
        + (f"   top-5 {100 * metrics['top5']:.2f}%" if "top5" in metrics else "")
    )
    # a weights file's class names may hold line breaks or lone surrogates: shown escaped
    from vitlab.data.images import one_line

    if metrics.get("absent_classes"):
        absent = [one_line(str(name)) for name in metrics["absent_classes"]]
        lines.append(f"macro averages over {metrics['num_classes'] - len(absent)} of {metrics['num_classes']} classes: "
                     f"{', '.join(absent[:5])}{' ...' if len(absent) > 5 else ''} "
                     f"{'has' if len(absent) == 1 else 'have'} no test image and {'is' if len(absent) == 1 else 'are'} "
                     "never predicted")
    names = [one_line(str(r["name"])) for r in metrics["per_class"]]
    width = max([len("class")] + [len(name) for name in names])
    lines.append(f"{'class'.ljust(width)}  precision  recall     f1  support")
    for name, r in zip(names, metrics["per_class"]):
        lines.append(
            f"{name.ljust(width)}  {100 * r['precision']:9.2f}  {100 * r['recall']:6.2f}  {100 * r['f1']:5.2f}  {r['support']:7d}"
        )
    return "\n".join(lines)
