"""The Fig. 7 summary numbers: each statistic separates the structure it claims to detect from noise."""

import json
from pathlib import Path

import numpy as np
import torch

from vitlab.inspect import embedding_filter_pca, inspect_model, posemb_similarity
from vitlab.inspect.summary import distance_summary, filter_summary, low_frequency_share, posemb_summary
from vitlab.models.posemb import sincos_2d
from vitlab.models.registry import create_model


def _smooth_filters(n: int = 32, p: int = 8) -> np.ndarray:
    """Random mixtures of low-frequency ramps and blobs: what the paper's Fig. 7 components look like."""
    rng = np.random.default_rng(0)
    y, x = np.meshgrid(np.linspace(-1, 1, p), np.linspace(-1, 1, p), indexing="ij")
    basis = np.stack([x, y, x * y, x**2, y**2, np.exp(-(x**2 + y**2))])
    return np.einsum("nb,bij->nij", rng.standard_normal((n, len(basis))), basis)[:, None]


def test_low_frequency_share_separates_smooth_from_checkerboard():
    p = 8
    checker = (np.indices((p, p)).sum(0) % 2 * 2 - 1.0)[None, None]
    assert low_frequency_share(checker) < 0.01
    assert low_frequency_share(np.ones((1, 1, p, p))) > 0.99
    assert low_frequency_share(_smooth_filters(p=p)) > 0.9


def test_filter_summary_against_random_kernel():
    smooth = _smooth_filters()
    s = filter_summary(embedding_filter_pca(smooth, 6), smooth.shape, top=4)
    assert s["low_frequency_share"] > 0.9 > 0.5 > s["low_frequency_share_random_kernel"]
    # six basis functions: the top five components hold nearly all of the variance, a random kernel far less
    assert s["explained_variance_top5"] > 0.95 > s["explained_variance_top5_random_kernel"]


def test_posemb_summary_sees_2d_structure_and_not_noise():
    grid = (7, 7)
    structured = posemb_summary(posemb_similarity(sincos_2d(grid, 64), grid, 0))
    assert structured["neighbours"] > structured["neither_row_nor_column"]
    assert structured["same_row"] > structured["neither_row_nor_column"]
    assert structured["correlation_with_distance"] < -0.5
    noise = posemb_summary(posemb_similarity(torch.randn(49, 64, generator=torch.Generator().manual_seed(0)), grid, 0))
    assert abs(noise["correlation_with_distance"]) < 0.1
    assert abs(noise["neighbours"] - noise["neither_row_nor_column"]) < 0.1


def test_distance_summary_counts_local_heads_and_trend():
    d = np.array([[2.0, 14.0], [8.0, 14.0], [13.0, 15.0]])  # layer 1 has a local head; distance grows
    s = distance_summary(d, uniform=14.0, width=28)
    assert s["local_heads_per_layer"] == [1, 0, 0]
    assert s["layer_min_px"] == [2.0, 8.0, 13.0] and s["layer_max_px"] == [14.0, 14.0, 15.0]
    assert s["slope_px_per_layer"] > 0


def test_inspect_json_carries_the_summary(tmp_path):
    model = create_model("custom", dim=32, depth=2, heads=2, mlp_dim=64, patch_size=4, image_size=16,
                         num_classes=3, seed=0)
    res = inspect_model(model, torch.randn(4, 3, 16, 16), tmp_path, progress=False, rollout_images=2)
    info = json.loads((tmp_path / "inspect.json").read_text())
    assert set(info["summary"]) == {"filters", "posemb", "distance"} == set(res.summary)
    assert len(info["summary"]["distance"]["layer_mean_px"]) == 2
    assert "position embeddings: mean cosine similarity" in (tmp_path / "report.html").read_text()


def test_the_kept_fashion_mnist_vit_regenerates_its_committed_numbers(tmp_path):
    """docs/RESULTS.md's inspection model is in the repository; its data-free figures (filters, position
    embeddings) regenerate to the numbers committed beside them."""
    import vitlab

    docs = Path(__file__).resolve().parents[1] / "docs" / "figures"
    model = vitlab.load(docs / "fmnist_vit_model")
    cfg = model.config
    assert (cfg.patch_size, cfg.grid_size, cfg.posemb, cfg.classifier) == (4, (7, 7), "learn", "token")
    res = inspect_model(model, None, tmp_path, progress=False)
    committed = json.loads((docs / "inspect_fmnist_vit" / "inspect.json").read_text())["summary"]
    assert res.summary["posemb"] == committed["posemb"]
    assert res.summary["filters"] == committed["filters"]
