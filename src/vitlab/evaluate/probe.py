"""Linear probe on cached frozen features: L2-regularised multinomial logistic regression.

We use scikit-learn's `LogisticRegression` (L-BFGS) on features standardised with training
statistics instead of DINO's 100-epoch SGD over augmented images: on cached features it is
deterministic, needs no learning-rate schedule and takes seconds on a CPU. The inverse
regularisation strength C is chosen on the validation features when given (else C = 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_CS = (0.01, 0.1, 1.0, 10.0)


@dataclass
class LinearProbe:
    mean: np.ndarray
    std: np.ndarray
    model: object  # sklearn LogisticRegression
    C: float
    num_classes: int

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
) -> LinearProbe:
    """Fit the probe; with validation features, pick C from `cs` by validation accuracy, refit on train."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning

    x = np.asarray(train_x, np.float64)
    y = np.asarray(train_y, np.int64)
    mean = x.mean(axis=0, keepdims=True)
    std = x.std(axis=0, keepdims=True) + 1e-5
    z = (x - mean) / std
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        best_c = 1.0
        if val_x is not None and val_y is not None and len(val_y) and len(cs) > 1:
            zv = (np.asarray(val_x, np.float64) - mean) / std
            accs = [(float((_fit(z, y, c, max_iter, seed).predict(zv) == np.asarray(val_y)).mean()), -i, c)
                    for i, c in enumerate(cs)]
            best_c = max(accs)[2]  # best accuracy; ties go to the strongest regularisation
        model = _fit(z, y, best_c, max_iter, seed)
    return LinearProbe(mean=mean, std=std, model=model, C=float(best_c), num_classes=num_classes)
