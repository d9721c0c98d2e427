"""PCA of the patch-embedding filters: orthonormal components, decreasing variance, equal to the covariance eigensystem."""

import numpy as np
import pytest
import torch

from vitlab.errors import VitlabError
from vitlab.inspect import embedding_filter_pca


def test_orthonormal_decreasing_and_matches_eigendecomposition():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 3, 4, 4, generator=g) * torch.linspace(0.1, 2.0, 48).reshape(1, 3, 4, 4)
    pca = embedding_filter_pca(w, k=28)
    assert pca.components.shape == (28, 3, 4, 4)
    flat = pca.components.reshape(28, -1)
    np.testing.assert_allclose(flat @ flat.T, np.eye(28), atol=1e-10)
    assert np.all(np.diff(pca.explained_variance) <= 1e-12)
    x = w.reshape(64, -1).double().numpy()
    evals, evecs = np.linalg.eigh(np.cov(x, rowvar=False))
    evals, evecs = evals[::-1], evecs[:, ::-1]
    np.testing.assert_allclose(pca.explained_variance, evals[:28], rtol=1e-8)
    np.testing.assert_allclose(np.abs((flat * evecs[:, :28].T).sum(1)), 1.0, atol=1e-8)  # same axes up to sign
    np.testing.assert_allclose(pca.mean, x.mean(0).reshape(3, 4, 4), atol=1e-12)


def test_components_capped_by_patch_dimension():
    # Grey 4x4 patches: at most 16 components exist.
    pca = embedding_filter_pca(torch.randn(64, 1, 4, 4), k=28)
    assert pca.components.shape == (16, 1, 4, 4)
    assert pca.explained_variance_ratio.sum() == pytest.approx(1.0)


def test_rank_two_filters_have_two_components():
    a, b = np.random.default_rng(0).normal(size=(2, 12))
    coef = np.random.default_rng(1).normal(size=(30, 2))
    w = (coef @ np.stack([a, b])).reshape(30, 3, 2, 2)
    pca = embedding_filter_pca(w, k=5)
    assert pca.explained_variance_ratio[:2].sum() == pytest.approx(1.0, abs=1e-10)


def test_bad_kernel_shape():
    with pytest.raises(VitlabError):
        embedding_filter_pca(torch.randn(8, 16))
