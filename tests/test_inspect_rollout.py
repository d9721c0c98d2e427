"""Attention rollout against hand-computed answers (Abnar & Zuidema: A = 0.5 W + 0.5 I, product over layers)."""

import numpy as np
import pytest
import torch

from vitlab.errors import VitlabError
from vitlab.inspect import attention_maps, attention_rollout, fuse_heads, rollout_maps, token_map


def random_attention(b, h, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, n, n, generator=g).mul(3).softmax(-1)


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("discard", [0.0, 0.5, 0.9])
def test_rollout_rows_sum_to_one(fusion, discard):
    layers = [random_attention(3, 4, 10, seed=i) for i in range(4)]
    r = attention_rollout(layers, head_fusion=fusion, discard_ratio=discard)
    assert r.shape == (3, 10, 10)
    np.testing.assert_allclose(r.sum(-1), 1.0, atol=1e-12)
    assert (r >= 0).all()


def test_identity_attention_gives_identity():
    eye = torch.eye(17).expand(2, 3, 17, 17)
    r = attention_rollout([eye] * 5)
    np.testing.assert_allclose(r, np.broadcast_to(np.eye(17), (2, 17, 17)), atol=1e-15)


def test_matches_paper_formula_by_hand():
    # Two layers, one image, two heads; reference: mean over heads, 0.5 W + 0.5 I, R = A2 @ A1.
    a1 = random_attention(1, 2, 5, seed=1)[0].double().numpy()
    a2 = random_attention(1, 2, 5, seed=2)[0].double().numpy()
    ref1 = 0.5 * a1.mean(0) + 0.5 * np.eye(5)
    ref2 = 0.5 * a2.mean(0) + 0.5 * np.eye(5)
    expected = ref2 @ ref1
    got = attention_rollout([a1, a2])  # unbatched input -> (N, N)
    np.testing.assert_allclose(got, expected, atol=1e-12)


def test_rows_not_columns_are_normalised():
    # Max fusion of a non-symmetric matrix: rows of fuse+I do not sum to 2, so the axis matters.
    a = random_attention(1, 3, 6, seed=3)
    fused = a.amax(1)[0].double().numpy() + np.eye(6)
    expected = fused / fused.sum(1, keepdims=True)
    got = attention_rollout([a], head_fusion="max")[0]
    np.testing.assert_allclose(got, expected, atol=1e-12)
    wrong = fused / fused.sum(0, keepdims=True)  # the well-known script's broadcast
    assert not np.allclose(got, wrong)


def test_head_fusion_reference():
    a = random_attention(2, 3, 4, seed=4)
    np.testing.assert_allclose(fuse_heads(a, "max").numpy(), a.numpy().max(1))
    np.testing.assert_allclose(fuse_heads(a, "min").numpy(), a.numpy().min(1))
    with pytest.raises(VitlabError):
        fuse_heads(a, "median")


def test_discard_ratio_zeroes_lowest_but_keeps_class_entry():
    a = torch.tensor([[0.01, 0.5, 0.49], [0.2, 0.3, 0.5], [0.15, 0.6, 0.25]], dtype=torch.float64)[None, None]
    # discard 0.5 of 9 entries = the 4 smallest (0.01, 0.15, 0.2, 0.25); class->class (0.01) survives.
    got = attention_rollout([a], discard_ratio=0.5)[0]
    kept = np.array([[0.01, 0.5, 0.49], [0.0, 0.3, 0.5], [0.0, 0.6, 0.0]]) + np.eye(3)
    np.testing.assert_allclose(got, kept / kept.sum(1, keepdims=True), atol=1e-12)


def test_class_row_maps_to_grid_row_major():
    # Non-square 2x3 grid; the class token attends only to patch (row 1, col 2) = token 1 + 5.
    n = 1 + 6
    a = torch.eye(n).expand(1, 2, n, n).clone()
    a[:, :, 0] = 0
    a[:, :, 0, 6] = 1.0
    m = rollout_maps([a], (2, 3), num_prefix_tokens=1)[0]
    assert m.shape == (2, 3)
    assert m[1, 2] == 1.0 and m.argmax() == 5
    raw = attention_maps([a, a], (2, 3), num_prefix_tokens=1)
    assert raw.shape == (2, 2, 2, 3)
    assert raw[0, 0, 1, 2] == 1.0 and raw[0, 0].sum() == 1.0


def test_gap_models_use_mean_over_query_rows():
    r = np.arange(16, dtype=float).reshape(4, 4)
    m = token_map(r, (2, 2), num_prefix_tokens=0)
    np.testing.assert_allclose(m.ravel(), r.mean(0))


def test_shape_errors_are_one_line():
    with pytest.raises(VitlabError):
        token_map(np.eye(5), (2, 3), 1)
    with pytest.raises(VitlabError):
        attention_rollout([])


def test_model_attention_rollout_rows_sum_to_one():
    from vitlab.models.registry import create_model

    model = create_model("custom", dim=32, depth=2, heads=2, mlp_dim=64, patch_size=4, image_size=(8, 12),
                         in_chans=1, num_classes=3, seed=0).eval()
    with torch.no_grad():
        logits, attn = model(torch.randn(2, 1, 8, 12), return_attention=True)
    assert len(attn) == 2 and attn[0].shape == (2, 2, 7, 7)
    r = attention_rollout(attn)
    np.testing.assert_allclose(r.sum(-1), 1.0, atol=1e-6)
    assert rollout_maps(attn, (2, 3)).shape == (2, 2, 3)
