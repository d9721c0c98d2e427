"""Frozen-feature evaluation: ridge vs numpy least squares, kNN on a hand-made toy set, probe, zero-shot."""

import math

import numpy as np
import pytest
import torch

from vitlab.errors import VitlabError
from vitlab.evaluate.fewshot import BIAS_CONSTANT, fewshot_eval, fit_ridge, needed_indices
from vitlab.evaluate.knn import knn_predict, knn_scores
from vitlab.evaluate.probe import fit_probe
from vitlab.evaluate.zeroshot import mapped_scores, parse_class_map, with_fresh_head
from vitlab.models import create_model


def _lstsq_ridge(x, y, k, lam):
    """Reference: whiten, append 100, solve [Xa; sqrt(lam) I] W = [Y; 0] with numpy lstsq."""
    mean = x.mean(0)
    std = np.sqrt(((x - mean) ** 2).mean(0)) + 1e-5
    xa = np.hstack([(x - mean) / std, np.full((len(x), 1), 100.0)])
    targets = np.where(np.arange(k)[None, :] == y[:, None], 1.0, -1.0)
    d = xa.shape[1]
    a = np.vstack([xa, math.sqrt(lam) * np.eye(d)])
    b = np.vstack([targets, np.zeros((d, k))])
    w = np.linalg.lstsq(a, b, rcond=None)[0]
    return w, mean, std


@pytest.mark.parametrize("n,d", [(200, 16), (12, 40)])  # N >= D and N < D branches
@pytest.mark.parametrize("lam", [1024.0, 0.5])
def test_ridge_matches_lstsq(n, d, lam):
    rng = np.random.default_rng(n + d)
    k = 4
    x = rng.normal(size=(n, d)) * rng.uniform(0.1, 5, size=d) + rng.normal(size=d)
    y = np.arange(n) % k
    clf = fit_ridge(x, y, k, lam)
    w, mean, std = _lstsq_ridge(x, y, k, lam)
    np.testing.assert_allclose(clf.weights, w, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(clf.mean[0], mean, rtol=1e-10)
    np.testing.assert_allclose(clf.std[0], std, rtol=1e-10)
    xt = rng.normal(size=(30, d))
    xta = np.hstack([(xt - mean) / std, np.full((30, 1), BIAS_CONSTANT)])
    np.testing.assert_allclose(clf.scores(xt), xta @ w, rtol=1e-6, atol=1e-8)
    assert np.array_equal(clf.predict(xt), (xta @ w).argmax(1))


def test_fewshot_protocol_and_subset_extraction():
    rng = np.random.default_rng(0)
    k, d = 3, 8
    centres = rng.normal(size=(k, d)) * 3
    ytr = np.repeat(np.arange(k), 40)
    xtr = centres[ytr] + rng.normal(size=(len(ytr), d))
    yte = np.repeat(np.arange(k), 20)
    xte = centres[yte] + rng.normal(size=(len(yte), d))
    out = fewshot_eval(xtr, ytr, xte, yte, k, shots=(1, 5, 25), seeds=3)
    assert out["shots"] == [1, 5, 25] and out["l2_reg"] == 1024.0 and out["seeds"] == 3
    # the protocol by hand: seed s, class c -> first k of default_rng(s).permutation(where(y == c))
    for res in out["results"]:
        for s in range(3):
            r = np.random.default_rng(s)
            idx = np.concatenate([r.permutation(np.where(ytr == c)[0])[: res["shots"]] for c in range(k)])
            w, mean, std = _lstsq_ridge(xtr[idx], ytr[idx], k, 1024.0)
            pred = (np.hstack([(xte - mean) / std, np.full((len(xte), 1), 100.0)]) @ w).argmax(1)
            assert res["accuracy_per_seed"][s] == pytest.approx((pred == yte).mean())
        assert res["mean"] == pytest.approx(np.mean(res["accuracy_per_seed"]))
    assert out["results"][-1]["mean"] > 0.9  # well-separated clusters
    # only the rows the sampling needs: the same numbers
    rows = needed_indices(ytr, k, (1, 5, 25), 3)
    assert len(rows) < len(ytr)
    sub = fewshot_eval(xtr[rows], ytr, xte, yte, k, shots=(1, 5, 25), seeds=3, train_index=rows)
    assert sub["results"] == out["results"]
    with pytest.raises(VitlabError):
        fewshot_eval(xtr[rows[:5]], ytr, xte, yte, k, shots=(25,), seeds=1, train_index=rows[:5])


def test_knn_weighted_vote_hand_computed():
    # 2-D unit vectors; the test point is (1, 0). Neighbours (k=3): one class-0 point at cos 1.0,
    # two class-1 points at cos 0.8. Majority would say 1; the exp(s/T) weights say 0.
    s = math.sqrt(1 - 0.8**2)
    train = np.array([[1.0, 0.0], [0.8, s], [0.8, -s], [-1.0, 0.0], [0.0, 1.0]])
    labels = np.array([0, 1, 1, 0, 2])
    test = np.array([[2.0, 0.0]])  # not unit length: must be normalised
    scores = knn_scores(train, labels, test, 3, k=3, temperature=0.07)
    # the sums of exp(s/T), each row scaled by exp(-max s/T) so that small T cannot overflow (nearest weighs 1)
    expected = [1.0, 2 * math.exp((0.8 - 1.0) / 0.07), 0.0]
    np.testing.assert_allclose(scores[0].numpy(), expected, rtol=1e-4)
    assert knn_predict(train, labels, test, 3, k=3).tolist() == [0]
    # with a high temperature the weights are nearly equal: the majority wins
    assert knn_predict(train, labels, test, 3, k=3, temperature=100.0).tolist() == [1]
    # k larger than the training set is clipped
    assert knn_scores(train, labels, test, 3, k=50).shape == (1, 3)


def test_knn_toy_clusters():
    rng = np.random.default_rng(1)
    dirs = np.eye(4)[:3]
    ytr = np.repeat(np.arange(3), 30)
    xtr = dirs[ytr] + 0.1 * rng.normal(size=(90, 4))
    yte = np.array([0, 1, 2, 2, 1, 0])
    xte = dirs[yte] * 5 + 0.1 * rng.normal(size=(6, 4))
    assert knn_predict(torch.tensor(xtr), torch.tensor(ytr), torch.tensor(xte), 3).tolist() == yte.tolist()


def test_probe_selects_c_and_separates():
    rng = np.random.default_rng(2)
    centres = rng.normal(size=(3, 5)) * 4
    y = np.repeat(np.arange(3), 30)
    x = centres[y] + rng.normal(size=(90, 5))
    yv = np.repeat(np.arange(3), 10)
    xv = centres[yv] + rng.normal(size=(30, 5))
    probe = fit_probe(x, y, 4, xv, yv)  # class 3 never seen: probability 0
    assert probe.C in (0.01, 0.1, 1.0, 10.0)
    assert (probe.predict(xv) == yv).mean() > 0.9
    scores = probe.scores(xv)
    assert scores.shape == (30, 4) and np.allclose(scores[:, 3], 0) and np.allclose(scores.sum(1), 1)
    assert fit_probe(x, y, 3).C == 1.0


def test_zero_shot_class_map():
    names = ["Sandal", "Sneaker", "Ankle boot"]
    assert parse_class_map("Sandal=774, sneaker=770+630,Ankle boot=514", names, 1000) == [[774], [770, 630], [514]]
    assert parse_class_map("0=1,1=2,2=3", names) == [[1], [2], [3]]
    for bad in ("Sandal=774,Sneaker=770", "Boot=1,Sandal=2,Sneaker=3", "Sandal=x,Sneaker=1,Ankle boot=2",
                "Sandal=1000,Sneaker=1,Ankle boot=2", "Sandal"):
        with pytest.raises(VitlabError):
            parse_class_map(bad, names, 1000)
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.1, 0.1, 0.3]]))
    s = mapped_scores(logits, [[0], [1, 2], [3]])
    np.testing.assert_allclose(s.numpy(), [[0.1, 0.5, 0.4], [0.5, 0.2, 0.3]], rtol=1e-6)
    # one index per class: the same argmax as the restricted logits
    assert mapped_scores(logits, [[3], [0]]).argmax(1).tolist() == logits[:, [3, 0]].argmax(1).tolist()


def test_fresh_head_is_random_seeded_and_leaves_model():
    model = create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=4, image_size=8,
                         in_chans=1, num_classes=10, seed=0)
    a, b = with_fresh_head(model, 3, seed=5), with_fresh_head(model, 3, seed=5)
    assert a.head.out_features == 3 and model.head.out_features == 10
    assert torch.equal(a.head.weight, b.head.weight) and a.head.weight.abs().sum() > 0
    assert not torch.equal(with_fresh_head(model, 3, seed=6).head.weight, a.head.weight)
