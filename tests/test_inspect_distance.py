"""Mean attention distance against closed forms (identity -> 0, uniform -> mean pairwise distance)."""

import numpy as np
import pytest
import torch
from scipy.spatial.distance import cdist, pdist

from vitlab.errors import VitlabError
from vitlab.inspect import (
    attention_distance,
    mean_attention_distance,
    patch_distances,
    uniform_attention_distance,
)


def grid_points(h, w):
    return np.array([(r, c) for r in range(h) for c in range(w)], dtype=float)


def test_patch_distances_match_scipy():
    pts = grid_points(3, 5)
    np.testing.assert_allclose(patch_distances((3, 5), stride=16), cdist(pts, pts) * 16)


@pytest.mark.parametrize("cls", ["exclude", "zero"])
@pytest.mark.parametrize("prefix", [0, 1])
def test_identity_attention_has_zero_distance(cls, prefix):
    n = prefix + 12
    eye = torch.eye(n).expand(2, 3, n, n)
    d = attention_distance([eye, eye], (3, 4), stride=8, num_prefix_tokens=prefix, cls=cls)
    assert d.shape == (2, 2, 3)
    np.testing.assert_allclose(d, 0.0, atol=1e-12)


def test_uniform_attention_closed_form_2x2():
    # Each query: distances 0, 1, 1, sqrt(2) patches -> mean (2 + sqrt 2) / 4 patches, times stride 16.
    u = torch.full((1, 1, 4, 4), 0.25)
    d = mean_attention_distance([u], (2, 2), stride=16, num_prefix_tokens=0)
    np.testing.assert_allclose(d, [[(2 + np.sqrt(2)) / 4 * 16]], atol=1e-12)


def test_uniform_attention_closed_form_with_class_token():
    h, w, stride = 3, 5, 4
    n = h * w
    closed = 2 * pdist(grid_points(h, w)).sum() / n**2 * stride  # mean over all ordered pairs
    u = torch.full((2, 4, n + 1, n + 1), 1.0 / (n + 1))
    excl = mean_attention_distance([u], (h, w), stride, num_prefix_tokens=1, cls="exclude")
    zero = mean_attention_distance([u], (h, w), stride, num_prefix_tokens=1, cls="zero")
    np.testing.assert_allclose(excl, closed, atol=1e-10)
    np.testing.assert_allclose(zero, closed * n / (n + 1), atol=1e-10)  # attention to CLS counts as 0
    assert uniform_attention_distance((h, w), stride) == pytest.approx(closed)


def test_one_hot_attention_to_corner():
    # Every query attends only to patch (0, 0): mean over queries of their distance to the corner.
    h, w, stride = 2, 3, 10
    a = torch.zeros(1, 1, h * w, h * w)
    a[..., 0] = 1.0
    d = mean_attention_distance([a], (h, w), stride, num_prefix_tokens=0)
    expected = np.linalg.norm(grid_points(h, w), axis=1).mean() * stride
    np.testing.assert_allclose(d, [[expected]], atol=1e-12)


def test_per_head_and_layer_layout():
    n = 4
    eye = torch.eye(n).expand(1, 1, n, n)
    u = torch.full((1, 1, n, n), 0.25)
    layer = torch.cat([eye, u], dim=1)  # head 0 local, head 1 global
    d = mean_attention_distance([layer, torch.cat([u, eye], dim=1)], (2, 2), 1.0, num_prefix_tokens=0)
    g = (2 + np.sqrt(2)) / 4
    np.testing.assert_allclose(d, [[0, g], [g, 0]], atol=1e-12)


def test_bad_inputs():
    with pytest.raises(VitlabError):
        attention_distance([torch.eye(5)[None, None]], (2, 3), 1.0, 1)
    with pytest.raises(VitlabError):
        attention_distance([torch.eye(5)[None, None]], (2, 2), 1.0, 1, cls="both")
