"""Linear probe on cached frozen features: L2-regularised multinomial logistic regression.

We use scikit-learn's `LogisticRegression` (L-BFGS) on features standardised with training
statistics instead of DINO's 100-epoch SGD over augmented images: on cached features it is
deterministic and needs no learning-rate schedule. The inverse regularisation strength C is chosen
on the validation features when given (else C = 1); each candidate is fitted once (docs/evaluation.md
has the measured time on Fashion-MNIST).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vitlab.errors import VitlabError

DEFAULT_CS = (0.01, 0.1, 1.0, 10.0)


@dataclass
class LinearProbe:
    mean: np.ndarray
    std: np.ndarray
    model: object  # sklearn LogisticRegression
    C: float
    num_classes: int
    converged: bool = True  # False: L-BFGS stopped at max_iter (its ConvergenceWarning is silenced, this says it)

    def scores(self, x: np.ndarray) -> np.ndarray:
        """(N, K) class probabilities; classes absent from training get probability 0."""
        z = (np.asarray(x, np.float64) - self.mean) / self.std
        p = self.model.predict_proba(z)
        out = np.zeros((len(z), self.num_classes))
        out[:, self.model.classes_] = p
        return out

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.scores(x).argmax(axis=1)


def _fit(z: np.ndarray, y: np.ndarray, c: float, max_iter: int, seed: int):
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(C=c, max_iter=max_iter, tol=1e-6, random_state=seed).fit(z, y)


def fit_probe(
    train_x: np.ndarray,
    train_y: np.ndarray,
    num_classes: int,
    val_x: np.ndarray | None = None,
    val_y: np.ndarray | None = None,
    cs: Sequence[float] = DEFAULT_CS,
    max_iter: int = 1000,
    seed: int = 0,
    progress: bool = False,
) -> LinearProbe:
    """Fit the probe; with validation features, pick C from `cs` by validation accuracy.

    The fit for the chosen C is the fit made while choosing (same data, C and seed, so the same model a
    refit would give): one L-BFGS fit per candidate C, none more. `progress` shows a bar over those fits.
    """
    import warnings

    from sklearn.exceptions import ConvergenceWarning

    from vitlab.progress import progress_bar

    x = np.asarray(train_x, np.float64)
    y = np.asarray(train_y, np.int64)
    if len(np.unique(y)) < 2:  # scikit-learn's own ValueError read as an unexpected failure
        raise VitlabError(f"the linear probe needs training images of at least 2 classes; the training features hold "
                          f"{len(np.unique(y))}: evaluate data with more classes, or drop --probe")
    mean = x.mean(axis=0, keepdims=True)
    std = x.std(axis=0, keepdims=True) + 1e-5
    z = (x - mean) / std
    choose = val_x is not None and val_y is not None and len(val_y) > 0 and len(cs) > 1
    candidates = list(cs) if choose else [1.0]
    zv = (np.asarray(val_x, np.float64) - mean) / std if choose else None
    bar = progress_bar(candidates, desc=f"linear probe: L-BFGS fits on {len(y)} features", unit="fit",
                       enabled=progress)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        fits = []
        for i, c in enumerate(bar):
            bar.set_postfix_str(f"C={c:g}", refresh=False)
            model = _fit(z, y, c, max_iter, seed)
            acc = 0.0
            if choose:
                acc = float((model.predict(zv) == np.asarray(val_y)).mean())
            fits.append((acc, -i, c, model))
    _, _, best_c, model = max(fits, key=lambda f: f[:3])  # best accuracy; ties go to the strongest regularisation
    converged = int(np.max(model.n_iter_)) < max_iter
    return LinearProbe(mean=mean, std=std, model=model, C=float(best_c), num_classes=num_classes, converged=converged)
