"""Audit 15: evaluation numerics against independent references (values hard-coded, references named per test).

The defect fixed here: a mapped (zero-shot) head's scores were softmax probabilities in float32, which underflow to 0
once a logit is ~104 below the head's largest. A test image that the head gives, confidently, to a class outside the
map then scored 0 for every data class: argmax said class 0, top-5 took classes 0-4, and the mapped loss read 0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vitlab.evaluate.fewshot import fit_ridge
from vitlab.evaluate.metrics import classification_metrics, wilson_interval
from vitlab.evaluate.runner import head_loss
from vitlab.evaluate.zeroshot import mapped_scores


def _dominated_logits() -> tuple[torch.Tensor, list[list[int]], np.ndarray]:
    """A 10-class head; data classes -> head [[2], [1], [3, 4]]; head class 9 (not mapped) leads by 110-300."""
    logits = torch.zeros(4, 10)
    logits[0, [9, 1, 2, 3, 4]] = torch.tensor([120.0, 2, 1, 0.5, 0.5])
    logits[1, [9, 1, 2, 3, 4]] = torch.tensor([150.0, 0, 3, 1, 1])
    logits[2, [9, 1, 2, 3, 4]] = torch.tensor([300.0, 0, 0, 1.5, 1.25])
    logits[3, [9, 1, 2, 3, 4]] = torch.tensor([110.0, 5, 0, 0, 0])
    return logits, [[2], [1], [3, 4]], np.array([1, 0, 2, 1])


def test_mapped_head_predicts_the_restricted_argmax_when_an_unmapped_class_dominates():
    # Reference (scipy 1.17.1): log P(class) = scipy.special.logsumexp(L[:, idx]) - logsumexp(L), argmax ->
    # [1, 0, 2, 1]. The old float32 scores were all 0 and predicted [0, 0, 0, 0].
    logits, cmap, y = _dominated_logits()
    scores = mapped_scores(logits, cmap)
    assert scores.argmax(dim=1).tolist() == [1, 0, 2, 1]
    assert classification_metrics(y, scores.argmax(dim=1).numpy(), 3, logits=scores)["accuracy"] == 1.0


def test_mapped_head_loss_when_an_unmapped_class_dominates():
    # Reference (scipy 1.17.1): mean over rows of -(lp[y] - logsumexp(lp)), lp = the log-probabilities above:
    # 0.27936174380597834. The old code returned 0.0 (all-zero scores floored at 1e-30 on both sides).
    logits, cmap, y = _dominated_logits()
    assert head_loss(mapped_scores(logits, cmap), y, mapped=True) == pytest.approx(0.27936174380597834, rel=1e-9)


def test_mapped_head_top5_when_an_unmapped_class_dominates():
    # 9-class head, 7 data classes mapped to head classes 1..7, head class 0 (unmapped) at logit 200.
    # Reference (scikit-learn 1.9.1): top_k_accuracy_score(y, L[:, 1:8], k=5, labels=range(7)) = 4/6 and top-1
    # 2/6 (the restricted logits order the summed probabilities). The old code tied everything at 0: top-5 3/6, top-1 0.
    rows = [[6.4, 2.7, 0.4, 0.2, 8.1, 9.1, 6.1], [7.3, 5.4, 9.4, 8.2, 0.0, 8.6, 0.3],
            [7.3, 1.8, 8.6, 5.4, 3.0, 4.2, 0.3], [1.2, 6.7, 6.5, 6.2, 3.8, 10.0, 9.8],
            [6.9, 6.5, 6.9, 3.9, 1.4, 7.2, 5.3], [3.1, 4.9, 8.9, 9.3, 3.6, 5.7, 3.2]]
    logits = torch.zeros(6, 9)
    logits[:, 0] = 200.0
    logits[:, 1:8] = torch.tensor(rows)
    y = np.array([5, 6, 4, 5, 4, 2])
    scores = mapped_scores(logits, [[i] for i in range(1, 8)])
    m = classification_metrics(y, scores.argmax(dim=1).numpy(), 7, logits=scores)
    assert m["top5"] == pytest.approx(4 / 6)
    assert m["accuracy"] == pytest.approx(2 / 6)


def test_wilson_interval_matches_statsmodels():
    # statsmodels 0.15.0: proportion_confint(count, n, alpha=0.05, method="wilson")
    ref = {(0, 5): (0.0, 0.43448246478317487), (3, 7): (0.15821985525146964, 0.7495416354723428),
           (277, 300): (0.8875898961498251, 0.9483723882133924), (2970, 3000): (0.9857604325031674, 0.9929862957460133),
           (1, 10000): (1.7652673601122363e-05, 0.0005662688974013383)}
    for (c, n), (lo, hi) in ref.items():
        got = wilson_interval(c, n)
        assert got[0] == pytest.approx(lo, abs=1e-15) and got[1] == pytest.approx(hi, abs=1e-15)


@pytest.mark.parametrize("dim", [3, 20])  # N >= D and N < D branches
def test_fit_ridge_matches_big_vision_fewshot_lsr(dim):
    # Reference: the bodies of big_vision's evaluators/fewshot_lsr.py `_precompute_cache` + `_eig_fewshot_acc_fn`
    # (whiten +1e-5, bias feature 100, targets 2 onehot - 1, eigh), run in jax 64-bit, lambda 16; scores x_test @ w.
    x = np.arange(15 * dim, dtype=np.float64).reshape(15, dim)
    x = np.sin(x * 1.3) + 0.1 * x / dim
    y = np.arange(15) % 5
    xt = np.cos(np.arange(4 * dim, dtype=np.float64).reshape(4, dim) * 0.7)
    ref = {3: [[-0.4910852544, -0.7704534269, -0.3785409132, -0.7016662923, -0.6579341474],
               [-0.7286808639, -0.3831969394, -0.3044381847, -1.1800462887, -0.4033177574],
               [-0.7520454427, -0.2831113505, -0.7859442038, -0.6880279301, -0.490551107],
               [-0.4908588, -0.7714234773, -0.3738740561, -0.7064350372, -0.6570886635]],
           20: [[-0.3069098532, -0.4464685552, -0.599842662, -0.753325465, -0.8931334987],
                [-0.2632473405, -0.4213899152, -0.5970151707, -0.7760416208, -0.9419859869],
                [-0.2166917221, -0.3992338753, -0.6005781901, -0.8011747087, -0.982001538],
                [-0.2476224633, -0.4182534048, -0.604380076, -0.78533181, -0.9440922801]]}[dim]
    np.testing.assert_allclose(fit_ridge(x, y, 5, 16.0).scores(xt), ref, atol=1e-9)


def _random_knn_problem():
    rng = np.random.default_rng(0)
    tr = rng.normal(size=(40, 6))
    te = rng.normal(size=(30, 6))
    return tr, np.arange(40) % 8, te, rng.integers(0, 8, 30)


@pytest.mark.parametrize(("k", "top1", "top5"), [(1, 2 / 30, 2 / 30), (3, 2 / 30, 9 / 30), (20, 2 / 30, 17 / 30)])
def test_knn_top5_is_dinos(k, top1, top5):
    # Reference: DINO's eval_knn.py `knn_classifier` (facebookresearch/dino 04c0ad9; torch 2.14, one chunk, features
    # L2-normalised as its main does, T = 0.07, 8 classes) on these features: top-1 / top-5 as parametrised. Its top-5
    # counts the first min(5, k) classes. The old top-5 took the 5 highest scores, classes without a vote (score 0)
    # included in class order: 18/30 at k = 1 and 17/30 at k = 3.
    from vitlab.evaluate.knn import knn_scores, knn_top5

    tr, ytr, te, yte = _random_knn_problem()
    scores = knn_scores(tr, ytr, te, 8, k, 0.07)
    assert float((scores.argmax(1).numpy() == yte).mean()) == pytest.approx(top1)
    assert knn_top5(scores, yte, k) == pytest.approx(top5)


def test_evaluate_model_knn_top5_with_fewer_than_5_neighbours():
    # DINO's top-5 with k = 1 is its top-1 (`correct.narrow(1, 0, min(5, k))`); metrics.json's knn.top5 was the top 5
    # of a vote in which only one class has a nonzero score.
    from vitlab.data import Preprocess, load_data
    from vitlab.evaluate.runner import FrozenOptions, evaluate_model
    from vitlab.models import create_model

    data = load_data("bundled", per_class=6, progress=False)
    assert len(data.class_names) > 5
    model = create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=7, image_size=28, in_chans=1,
                         num_classes=len(data.class_names), seed=0)
    res = evaluate_model(model, data, Preprocess.for_model(28, channels=1), frozen=FrozenOptions(knn=True, knn_k=1),
                         progress=False)
    assert res.knn["k"] == 1 and res.knn["top5"] == pytest.approx(res.knn["accuracy"])


def test_fewshot_plot_marks_incomplete_shot_counts(tmp_path, monkeypatch):
    """fewshot.png drew a shot count fitted on fewer images (a class smaller than the shots) like the others; the
    table said "incomplete", the figure nothing. Such points are now hollow and named in the legend."""
    from vitlab.evaluate import plots

    figures = []
    real_save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or real_save(fig, path))
    curves = {"m": ([1, 5, 10, 25], [0.4, 0.6, 0.7, 0.72], [0.1, 0.05, 0.02, 0.0])}
    plots.plot_fewshot(curves, tmp_path / "a.png", incomplete=[25])
    plots.plot_fewshot(curves, tmp_path / "b.png")
    labels = [[t.get_text() for t in fig.axes[0].get_legend().get_texts()] for fig in figures]
    assert any(text.startswith("incomplete") for text in labels[0])
    assert not any(text.startswith("incomplete") for text in labels[1])
    hollow = figures[0].axes[0].collections[-1]
    assert [tuple(p) for p in hollow.get_offsets()] == [(25.0, 72.0)]
