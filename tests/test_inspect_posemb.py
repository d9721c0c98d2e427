"""Position-embedding similarity against scikit-learn's cosine similarity; tiles on the patch grid."""

import numpy as np
import pytest
import torch
from sklearn.metrics.pairwise import cosine_similarity

from vitlab.errors import VitlabError
from vitlab.inspect import posemb_similarity, similarity_mosaic
from vitlab.models.posemb import sincos_2d


def test_matches_sklearn_and_excludes_class_slot():
    g = torch.Generator().manual_seed(0)
    pe = torch.randn(1, 1 + 12, 16, generator=g)
    pe[0, 0] = 1e6  # the class slot must not take part
    sim = posemb_similarity(pe, (3, 4), num_prefix_tokens=1)
    assert sim.shape == (3, 4, 3, 4)
    ref = cosine_similarity(pe[0, 1:].numpy().astype(np.float64))
    np.testing.assert_allclose(sim.reshape(12, 12), ref, atol=1e-12)


def test_diagonal_is_one_and_range():
    pe = torch.randn(1, 20, 8)
    sim = posemb_similarity(pe, (4, 5), num_prefix_tokens=0)
    for r in range(4):
        for c in range(5):
            assert sim[r, c, r, c] == pytest.approx(1.0)
    assert sim.min() >= -1 and sim.max() <= 1
    np.testing.assert_allclose(sim.reshape(20, 20), sim.reshape(20, 20).T)


def test_sincos_embedding_is_more_similar_to_neighbours():
    pe = sincos_2d((6, 6), 64)
    sim = posemb_similarity(pe, (6, 6), num_prefix_tokens=0)
    assert sim[2, 2, 2, 3] > sim[2, 2, 2, 5] and sim[2, 2, 3, 2] > sim[2, 2, 5, 2]


def test_mosaic_layout():
    sim = np.arange(2 * 3 * 2 * 3, dtype=float).reshape(2, 3, 2, 3)
    m = similarity_mosaic(sim, gap=1)
    assert m.shape == (2 * 3 - 1, 3 * 4 - 1)
    np.testing.assert_array_equal(m[3:5, 4:7], sim[1, 1])
    assert np.isnan(m[2, 0]) and np.isnan(m[0, 3])


def test_wrong_grid_is_one_line_error():
    with pytest.raises(VitlabError):
        posemb_similarity(torch.randn(1, 10, 4), (3, 3), num_prefix_tokens=0)
