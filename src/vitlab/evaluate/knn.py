"""Weighted k-nearest-neighbour classification on frozen features (DINO's `knn_classifier`).

Features are L2-normalised, similarity is the cosine, each of the k nearest training examples
votes for its label with weight exp(similarity / T); defaults k = 20, T = 0.07 as DINO.
Written by hand (a dozen lines of torch) because scikit-learn's KNeighborsClassifier has no
exp(s/T) weighting.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


@torch.no_grad()
def knn_scores(
    train_x: torch.Tensor | np.ndarray,
    train_y: torch.Tensor | np.ndarray,
    test_x: torch.Tensor | np.ndarray,
    num_classes: int,
    k: int = 20,
    temperature: float = 0.07,
    chunk: int = 1024,
    progress: bool = False,
) -> torch.Tensor:
    """(N_test, K) class scores: sums of exp(cos / T) over the k nearest training examples, each row scaled by
    exp(-max cos / T) (its nearest neighbour weighs 1) so that small temperatures cannot overflow.

    The (N_test, N_train) similarity matrix is computed `chunk` test rows at a time (bounded memory); with
    `progress` a bar on stderr counts those chunks.
    """
    from vitlab.progress import progress_bar

    tr = F.normalize(torch.as_tensor(np.asarray(train_x) if not isinstance(train_x, torch.Tensor) else train_x).float(), dim=1)
    te = F.normalize(torch.as_tensor(np.asarray(test_x) if not isinstance(test_x, torch.Tensor) else test_x).float(), dim=1)
    labels = torch.as_tensor(np.asarray(train_y) if not isinstance(train_y, torch.Tensor) else train_y).long()
    k = min(k, tr.shape[0])
    out = []
    starts = range(0, te.shape[0], chunk)
    for start in progress_bar(starts, desc=f"kNN: test rows x {tr.shape[0]} train, chunks of {chunk}", unit="chunk",
                              enabled=progress):
        sim = te[start:start + chunk] @ tr.T
        top_sim, top_idx = sim.topk(k, dim=1)
        # exp(s / T) overflows float32 once 1 / T passes ~88 (T < 0.0113): every class with a neighbour then scored
        # inf and argmax took the lowest such index. Scaling a row by exp(-max s / T) keeps the vote's ratios, so the
        # prediction (and the order of the scores) is DINO's; the nearest neighbour's weight is 1.
        weights = ((top_sim - top_sim[:, :1]) / temperature).exp()
        scores = torch.zeros(sim.shape[0], num_classes)
        scores.scatter_add_(1, labels[top_idx], weights)
        out.append(scores)
    return torch.cat(out) if out else torch.zeros(0, num_classes)


def knn_top5(scores: torch.Tensor | np.ndarray, labels, k: int) -> float:
    """DINO's kNN "top-5": the true class among the first min(5, k) classes of the vote. With k < 5 neighbours at
    most k classes get a vote and the others tie at 0; counting those (in class order) as top-5 hits gave 60 % where
    DINO's `knn_classifier` gives 6.7 % (k = 1, 8 classes, random features)."""
    from vitlab.evaluate.metrics import topk_accuracy

    return topk_accuracy(scores, labels, min(5, k))


def knn_predict(train_x, train_y, test_x, num_classes: int, k: int = 20, temperature: float = 0.07) -> np.ndarray:
    """Predicted class per test example (argmax of `knn_scores`)."""
    return knn_scores(train_x, train_y, test_x, num_classes, k, temperature).argmax(dim=1).numpy()
