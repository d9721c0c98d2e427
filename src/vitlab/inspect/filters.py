"""PCA of the patch-embedding filters (ViT paper Fig. 7 left, "first 28 principal components").

The kernel (D, C, P, P) is D filters, each a vector of length C*P*P; centring them and taking
the principal axes gives basis functions for the fine structure inside a patch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from sklearn.decomposition import PCA

from vitlab.errors import VitlabError


@dataclass(frozen=True)
class FilterPCA:
    """Top principal components of the embedding filters."""

    components: np.ndarray  # (k, C, P, P), orthonormal as flattened vectors
    explained_variance: np.ndarray  # (k,), decreasing
    explained_variance_ratio: np.ndarray  # (k,)
    mean: np.ndarray  # (C, P, P), the mean filter that was removed


def embedding_filter_pca(weight: np.ndarray | torch.Tensor, k: int = 28) -> FilterPCA:
    """PCA of a (D, C, P, P) patch-embedding kernel; k is capped at min(D, C*P*P)."""
    w = torch.as_tensor(weight).detach().to("cpu", torch.float64).numpy()
    if w.ndim != 4:
        raise VitlabError(f"expected a (D, C, P, P) patch-embedding kernel, got shape {w.shape}")
    d, c, ph, pw = w.shape
    k = min(int(k), d, c * ph * pw)
    if k < 1:
        raise VitlabError("need at least one principal component")
    pca = PCA(n_components=k, svd_solver="full").fit(w.reshape(d, -1))
    return FilterPCA(
        components=pca.components_.reshape(k, c, ph, pw),
        explained_variance=pca.explained_variance_,
        explained_variance_ratio=pca.explained_variance_ratio_,
        mean=pca.mean_.reshape(c, ph, pw),
    )


def tile_for_display(component: np.ndarray) -> np.ndarray:
    """(C, P, P) -> (P, P, C) in [0, 1] with a per-component symmetric scaling (0 maps to grey)."""
    peak = np.abs(component).max()
    img = 0.5 + 0.5 * component / (peak if peak > 0 else 1.0)
    return np.transpose(img, (1, 2, 0))
