"""Few-shot linear evaluation as the ViT paper (Sec. 4.1) and big_vision's `fewshot_lsr` evaluator.

Frozen features of k examples per class are whitened with their own mean/std (+1e-5), a constant
bias feature of 100 is appended (so the bias is almost unregularised), targets are 2*onehot-1, and
the ridge regression W = argmin |XW - Y|^2 + lambda |W|^2 (lambda = 1024) is solved in closed
form through an eigendecomposition of X^T X (N >= D) or X X^T (N < D). Prediction: argmax(x W).
Written by hand because it is a few lines of linear algebra and must match big_vision exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vitlab.errors import VitlabError

BIAS_CONSTANT = 100.0
DEFAULT_SHOTS = (1, 5, 10, 25)
DEFAULT_L2 = 2.0**10
DEFAULT_SEEDS = 3


@dataclass
class RidgeClassifier:
    """A fitted closed-form ridge classifier: whitening statistics and weights (D+1, K)."""

    mean: np.ndarray
    std: np.ndarray
    weights: np.ndarray

    def scores(self, x: np.ndarray) -> np.ndarray:
        return augment(np.asarray(x, np.float64), self.mean, self.std) @ self.weights

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.scores(x).argmax(axis=1)


def augment(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Whiten with the given statistics and append the constant bias feature."""
    x = (x - mean) / std
    return np.concatenate([x, np.full((x.shape[0], 1), BIAS_CONSTANT, x.dtype)], axis=1)


def fit_ridge(x: np.ndarray, y: np.ndarray, num_classes: int, l2_reg: float = DEFAULT_L2) -> RidgeClassifier:
    """Closed-form ridge regression onto {-1, 1} targets, big_vision's eigh formulation."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.int64)
    mean = x.mean(axis=0, keepdims=True)
    std = x.std(axis=0, keepdims=True) + 1e-5
    xa = augment(x, mean, std)
    targets = 2.0 * np.eye(num_classes)[y] - 1.0
    n, d = xa.shape
    # Both branches are lhs (diag(eigs) + lambda I)^-1 rhs; the eigendecomposition is of the
    # smaller Gram matrix, so several lambdas could reuse it.
    if n >= d:
        eigs, q = np.linalg.eigh(xa.T @ xa)
        lhs, rhs = q, q.T @ (xa.T @ targets)
    else:
        eigs, q = np.linalg.eigh(xa @ xa.T)
        lhs, rhs = xa.T @ q, q.T @ targets
    weights = (lhs / (eigs + l2_reg)[None, :]) @ rhs
    return RidgeClassifier(mean=mean, std=std, weights=weights)


def class_permutations(labels: np.ndarray, num_classes: int, seed: int) -> list[np.ndarray]:
    """Per-class random orders of the training indices; k shots are the first k (as big_vision)."""
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    return [rng.permutation(np.where(labels == c)[0]) for c in range(num_classes)]


def needed_indices(labels: np.ndarray, num_classes: int, shots: Sequence[int], seeds: int) -> np.ndarray:
    """Sorted training indices any (shots, seed) pair uses: extract only these features."""
    top = max(shots)
    idx = [p[:top] for s in range(seeds) for p in class_permutations(labels, num_classes, s)]
    return np.unique(np.concatenate(idx)) if idx else np.zeros(0, np.int64)


def fewshot_eval(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    num_classes: int,
    shots: Sequence[int] = DEFAULT_SHOTS,
    seeds: int = DEFAULT_SEEDS,
    l2_reg: float = DEFAULT_L2,
    train_index: np.ndarray | None = None,
    progress: bool = False,
) -> dict:
    """Accuracy for each shot count and seed, plus mean and sample standard deviation over seeds.

    `train_y` holds the labels of the whole training set; `train_x` the features of all of it, or
    only of the rows `train_index` (e.g. `needed_indices(...)`, to extract far fewer features).
    Returns {"shots", "seeds", "l2_reg", "results": [{"shots", "accuracy_per_seed", "mean",
    "std", "complete"}]}; `complete` is False when some class has fewer than k examples (it then
    contributes all it has). `progress` shows a bar over the (shots, seed) ridge fits.
    """
    from vitlab.progress import progress_bar

    train_x, test_x = np.asarray(train_x, np.float64), np.asarray(test_x, np.float64)
    train_y, test_y = np.asarray(train_y, np.int64), np.asarray(test_y, np.int64)
    rows = np.arange(len(train_y)) if train_index is None else np.asarray(train_index, np.int64)
    if len(train_x) != len(rows) or len(test_x) != len(test_y):
        raise VitlabError("features and labels differ in length; extract one feature vector per example")
    lookup = np.full(len(train_y), -1, np.int64)
    lookup[rows] = np.arange(len(rows))
    counts = np.bincount(train_y, minlength=num_classes)
    perms = [class_permutations(train_y, num_classes, s) for s in range(seeds)]
    results = []
    bar = progress_bar(total=len(shots) * seeds, desc="few-shot ridge: shots x seeds", unit="fit", enabled=progress)
    for k in shots:
        accs = []
        for s in range(seeds):
            bar.set_postfix_str(f"{k}-shot seed {s}", refresh=False)
            idx = np.concatenate([p[:k] for p in perms[s]])
            pos = lookup[idx]
            if (pos < 0).any():
                raise VitlabError("few-shot sampling needs features of training rows that were not extracted; "
                                  "pass the rows of needed_indices(...)")
            clf = fit_ridge(train_x[pos], train_y[idx], num_classes, l2_reg)
            accs.append(float((clf.predict(test_x) == test_y).mean()))
            bar.update()
        results.append({
            "shots": int(k),
            "accuracy_per_seed": accs,
            "mean": float(np.mean(accs)),
            # the seeds are a sample of the draws one could make: the sample std (n - 1), as error bars over
            # runs are usually given; the population std read 11 % low at 5 seeds
            "std": float(np.std(accs, ddof=1)) if len(accs) > 1 else 0.0,
            "complete": bool(counts.min() >= k),
        })
    bar.close()
    return {"shots": [int(k) for k in shots], "seeds": int(seeds), "l2_reg": float(l2_reg), "results": results}
