"""Audit 14 of `vitlab inspect`: the report's wording, kernels and images that are neither grey nor RGB, and the
analyses against independent numpy references (jacobgil/vit-explain rollout with the keepdim fix,
sayakpaul/probing-vits attention distance, the paper's cosine tiles, PCA by SVD)."""

import html
import re

import matplotlib
import numpy as np
import pytest
import torch

from vitlab.inspect import (
    attention_distance,
    attention_rollout,
    embedding_filter_pca,
    figures,
    inspect_model,
    posemb_similarity,
    rollout_maps,
)
from vitlab.models.registry import create_model


def _model(**kw):
    args = dict(dim=16, depth=2, heads=2, mlp_dim=32, patch_size=4, image_size=8, in_chans=1, num_classes=3, seed=0)
    args.update(kw)
    return create_model("custom", **args)


def _report_text(out) -> str:
    t = (out / "report.html").read_text()
    t = re.sub(r"<img[^>]*>", "", t)
    t = re.sub(r"</t[dh]>", " | ", t)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", t)))


def _inspect(model, tmp_path, n=3):
    torch.manual_seed(0)
    c = model.config.in_chans
    x = torch.randn(n, c, *model.config.image_size)
    return inspect_model(model, x, tmp_path, progress=False, rollout_images=2, mean=[0.5] * c, std=[0.5] * c)


# --- the report's words -------------------------------------------------------------------------------------

def test_settings_table_says_what_components_counts_and_why_fewer(tmp_path):
    # before: a bare "components | 28" row, although a grey 4x4 filter has only 16 values and 16 were shown
    _inspect(_model(), tmp_path)
    text = _report_text(tmp_path)
    assert "embedding-filter principal components (--components) | 28 asked, 16 shown: a 1x4x4 filter has only " \
           "16 values" in text
    assert "rollout: head fusion (--head-fusion) | mean" in text
    assert "attention distance: class token (--cls) | exclude" in text


def test_settings_table_for_a_hybrid_says_no_components_shown(tmp_path):
    _inspect(_model(conv_stem=[8], patch_size=2), tmp_path)
    assert "28 asked, none shown: a hybrid has no pixel filters" in _report_text(tmp_path)


def test_settings_table_says_cls_has_no_effect_without_a_class_token(tmp_path):
    _inspect(_model(classifier="gap"), tmp_path)
    assert "attention distance: class token (--cls) | exclude (no effect: the model has no class token)" \
        in _report_text(tmp_path)


def test_filters_section_explains_the_percentages(tmp_path):
    # the figure puts a percentage above each component; before, neither figure nor report said what it was
    _inspect(_model(), tmp_path)
    assert "the percentage above each its share of the filters' variance" in _report_text(tmp_path)


def test_rollout_caption_says_the_overlay_is_stretched_min_to_max(tmp_path):
    # before: "divided by its maximum and overlaid", but upsample_map stretches min..max to the full colour range,
    # so a map whose minimum is 0.6 of its maximum looked as peaked as one that is 0 almost everywhere
    res = _inspect(_model(), tmp_path)
    text = _report_text(tmp_path)
    assert "stretched from its own minimum (blue) to its maximum (red) and overlaid" in text
    lows = res.rollout_maps.reshape(len(res.rollout_maps), -1).min(1)
    assert f"{lows.min():.2f}" in text


# --- kernels and images that are neither grey nor RGB ---------------------------------------------------------

def test_two_channel_model_is_inspected(tmp_path):
    # before: matplotlib's "Invalid shape (4, 4, 2) for image data" from the filters figure, a bare traceback
    res = _inspect(_model(in_chans=2), tmp_path)
    assert {"filters", "rollout", "attention"} <= set(res.figures)
    assert "2 channels, shown as their grey mean" in _report_text(tmp_path)


def _drawn_arrays(monkeypatch):
    drawn = []
    original = matplotlib.axes.Axes.imshow

    def record(self, data, *args, **kwargs):
        drawn.append(np.asarray(data))
        return original(self, data, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "imshow", record)
    return drawn


def test_four_channel_filters_show_every_channel_not_an_rgb_of_three(tmp_path, monkeypatch):
    # before: the first 3 of 4 channels drawn as RGB, the 4th silently dropped
    rng = np.random.default_rng(0)
    pca = embedding_filter_pca(rng.standard_normal((20, 4, 3, 3)), 5)
    drawn = _drawn_arrays(monkeypatch)
    figures.plot_filters(pca, tmp_path / "f.png")
    assert len(drawn) == 5
    for a, comp in zip(drawn, pca.components):
        assert a.ndim == 2 and a.shape == (3, 4 * 4 - 1)  # 4 channels of 3x3, one-pixel gaps
        peak = np.abs(comp).max()
        np.testing.assert_allclose(a[:, 12:15], 0.5 + 0.5 * comp[3] / peak)  # the 4th channel is there


def test_four_channel_input_is_not_drawn_with_its_fourth_channel_as_alpha(tmp_path, monkeypatch):
    # before: an (H, W, 4) image went to imshow as RGBA, so the 4th channel made pixels transparent
    drawn = _drawn_arrays(monkeypatch)
    image = np.random.default_rng(0).random((8, 8, 4))
    figures.plot_rollout(image[None], np.ones((1, 2, 2)), tmp_path / "r.png")
    assert drawn[0].ndim == 2
    np.testing.assert_allclose(drawn[0], image.mean(-1))


# --- the analyses against independent references ------------------------------------------------------------

def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture
def attn():
    rng = np.random.default_rng(1)
    n = 1 + 3 * 5  # class token + a 3x5 grid
    return [_softmax(3 * rng.standard_normal((2, 2, n, n))) for _ in range(3)]


def test_attention_distance_matches_probing_vits_and_the_renormalised_variant(attn):
    grid, stride = (3, 5), 4
    pos = np.array([(r, c) for r in range(3) for c in range(5)])
    dist = stride * np.linalg.norm(pos[:, None] - pos[None], axis=-1)
    for mode in ("zero", "exclude"):
        ref = []
        for a in attn:
            p = a[..., 1:, 1:]  # probing-vits: class-token row and column dropped
            w = p / p.sum(-1, keepdims=True) if mode == "exclude" else p
            ref.append((w * dist).sum(-1).mean(-1))
        np.testing.assert_allclose(attention_distance(attn, grid, stride, 1, mode), np.stack(ref, 1), rtol=1e-12)


def test_rollout_matches_half_attention_half_identity_product(attn):
    n = attn[0].shape[-1]
    for b in range(2):
        joint = np.eye(n)
        for a in attn:
            joint = (0.5 * a[b].mean(0) + 0.5 * np.eye(n)) @ joint
        np.testing.assert_allclose(attention_rollout(attn)[b], joint, atol=1e-12)
        ref_map = joint[0, 1:].reshape(3, 5)
        np.testing.assert_allclose(rollout_maps(attn, (3, 5))[b], ref_map / ref_map.max(), atol=1e-12)


def test_posemb_cosine_tiles_and_filter_pca_by_svd():
    rng = np.random.default_rng(2)
    pe = rng.standard_normal((1, 1 + 2 * 3, 8))
    e = pe[0, 1:]
    cos = (e @ e.T) / np.outer(np.linalg.norm(e, axis=1), np.linalg.norm(e, axis=1))
    np.testing.assert_allclose(posemb_similarity(pe, (2, 3), 1), cos.reshape(2, 3, 2, 3), atol=1e-12)
    w = rng.standard_normal((30, 3, 2, 2))
    x = w.reshape(30, -1)
    _, s, vt = np.linalg.svd(x - x.mean(0), full_matrices=False)
    pca = embedding_filter_pca(w, 28)
    assert len(pca.components) == 12  # min(30 filters, 3*2*2 values)
    np.testing.assert_allclose(np.abs((pca.components.reshape(12, -1) * vt).sum(1)), 1.0, atol=1e-9)
    np.testing.assert_allclose(pca.explained_variance_ratio, (s**2 / (s**2).sum()), atol=1e-12)
