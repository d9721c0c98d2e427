"""Metrics against hand-computed cases and scikit-learn; plots write real PNGs."""

import math

import numpy as np
import pytest
import torch
from sklearn import metrics as skm

from vitlab.errors import VitlabError
from vitlab.evaluate.metrics import (
    classification_metrics,
    confusion_matrix,
    format_report,
    normal_interval,
    topk_accuracy,
    wilson_interval,
    write_confusion_csv,
)
from vitlab.evaluate.plots import plot_bars, plot_confusion_matrix, plot_fewshot, plot_lines


def test_hand_computed_three_classes():
    # true:  0 0 0 1 1 2 ; pred: 0 0 1 1 2 2
    m = classification_metrics([0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 2, 2], 3, ["a", "b", "c"])
    assert m["accuracy"] == pytest.approx(4 / 6)
    assert m["confusion_matrix"] == [[2, 1, 0], [0, 1, 1], [0, 0, 1]]
    # class a: P=2/2 R=2/3 F1=0.8; b: P=1/2 R=1/2 F1=0.5; c: P=1/2 R=1 F1=2/3
    f1 = [0.8, 0.5, 2 / 3]
    assert [r["f1"] for r in m["per_class"]] == pytest.approx(f1)
    assert m["macro_f1"] == pytest.approx(sum(f1) / 3)
    assert [r["support"] for r in m["per_class"]] == [3, 2, 1]
    assert [r["name"] for r in m["per_class"]] == ["a", "b", "c"]


def test_constant_predictor_macro_f1():
    # small-data.md 6.1: a constant predictor on a balanced 3-class set: acc 1/3, macro-F1 (0.5+0+0)/3
    y = [0] * 10 + [1] * 10 + [2] * 10
    m = classification_metrics(y, [0] * 30, 3)
    assert m["accuracy"] == pytest.approx(1 / 3)
    assert m["macro_f1"] == pytest.approx(0.5 / 3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_against_sklearn(seed):
    rng = np.random.default_rng(seed)
    k = 7
    y = rng.integers(0, k, 500)
    p = np.where(rng.random(500) < 0.6, y, rng.integers(0, k, 500))
    p[p == 6] = 5  # class 6 is never predicted: zero-division path
    m = classification_metrics(torch.tensor(y), torch.tensor(p), k)
    labels = list(range(k))
    assert m["accuracy"] == pytest.approx(skm.accuracy_score(y, p))
    assert m["macro_f1"] == pytest.approx(skm.f1_score(y, p, average="macro", labels=labels, zero_division=0))
    assert m["weighted_f1"] == pytest.approx(skm.f1_score(y, p, average="weighted", labels=labels, zero_division=0))
    prec, rec, f1, sup = skm.precision_recall_fscore_support(y, p, labels=labels, zero_division=0)
    assert [r["precision"] for r in m["per_class"]] == pytest.approx(prec.tolist())
    assert [r["recall"] for r in m["per_class"]] == pytest.approx(rec.tolist())
    assert [r["f1"] for r in m["per_class"]] == pytest.approx(f1.tolist())
    assert [r["support"] for r in m["per_class"]] == sup.tolist()
    assert np.array_equal(np.array(m["confusion_matrix"]), skm.confusion_matrix(y, p, labels=labels))


def test_a_class_with_no_test_image_and_no_prediction_is_left_out_of_the_macro_averages():
    """As scikit-learn's default (labels=None): class 'rare' (1 training image, none in test, never predicted)
    had counted as F1 0, and macro-F1 read 22.22 % where the 2 tested classes give 33.33 %."""
    y, p = [0, 0, 1, 1, 1], [0, 1, 1, 1, 0]
    m = classification_metrics(y, p, 3, ["cat", "dog", "rare"])
    for key, average in (("macro_f1", skm.f1_score), ("macro_precision", skm.precision_score),
                         ("macro_recall", skm.recall_score)):
        assert m[key] == pytest.approx(average(y, p, average="macro", zero_division=0))
    assert m["absent_classes"] == ["rare"] and m["per_class"][2]["support"] == 0
    assert "macro averages over 2 of 3 classes: rare has no test image" in format_report(m)
    # predicted but absent: a real error of the model, so it counts (F1 0), as in scikit-learn
    m = classification_metrics(y, [0, 2, 1, 1, 0], 3)
    assert m["absent_classes"] == [] and m["macro_f1"] == pytest.approx(
        skm.f1_score(y, [0, 2, 1, 1, 0], average="macro", zero_division=0))


def test_top5_against_sklearn():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(200, 10))
    y = rng.integers(0, 10, 200)
    m = classification_metrics(y, logits.argmax(1), 10, logits=torch.tensor(logits))
    assert m["top5"] == pytest.approx(skm.top_k_accuracy_score(y, logits, k=5, labels=list(range(10))))
    assert topk_accuracy(logits, y, 1) == pytest.approx(skm.accuracy_score(y, logits.argmax(1)))
    # no top-5 for 5 classes or fewer
    assert "top5" not in classification_metrics([0, 1], [0, 1], 3, logits=np.eye(3)[:2])


def test_wilson_interval_hand_computed():
    # p = 0.5, n = 100: centre 0.5, half = z*sqrt(0.0025 + z^2/40000)/(1+z^2/100)
    z = 1.959963984540054
    half = z * math.sqrt(0.25 / 100 + z * z / 40000) / (1 + z * z / 100)
    lo, hi = wilson_interval(50, 100)
    assert lo == pytest.approx(0.5 - half) and hi == pytest.approx(0.5 + half)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    # all correct: the interval keeps width, upper end 1 (normal approximation collapses)
    lo, hi = wilson_interval(10, 10)
    assert hi == pytest.approx(1.0) and lo == pytest.approx(10 / (10 + z * z))
    assert normal_interval(10, 10) == (1.0, 1.0)
    # small-data.md 6.1: n = 3000, p = 0.99 -> +-0.36 pp with the normal approximation
    lo, hi = normal_interval(2970, 3000)
    assert (hi - lo) / 2 == pytest.approx(0.0036, abs=5e-5)
    m = classification_metrics([0] * 50 + [1] * 50, [0] * 50 + [0] * 50, 2)
    assert m["accuracy_ci95"] == pytest.approx(list(wilson_interval(50, 100)))


def test_errors():
    with pytest.raises(VitlabError):
        confusion_matrix([0, 1], [0], 2)
    with pytest.raises(VitlabError):
        confusion_matrix([0, 3], [0, 1], 2)
    with pytest.raises(VitlabError):
        classification_metrics([0], [0], 2, ["only-one"])


def test_plots_and_csv(tmp_path):
    cm = [[5, 1, 0], [2, 3, 1], [0, 0, 6]]
    p = plot_confusion_matrix(cm, ["Sandal", "Sneaker", "Ankle boot"], tmp_path / "cm.png", title="t")
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    c = write_confusion_csv(cm, ["a", "b", "c"], tmp_path / "cm.csv").read_text().splitlines()
    assert c[0].split(",")[1:] == ["a", "b", "c"] and c[2] == "b,2,3,1"
    for f in (
        plot_lines({"m1": ([1, 2, 3], [1.0, 0.5, 0.2]), "m2": ([1, 2], [0.9, float("nan")])}, tmp_path / "l.png", "loss"),
        plot_bars({"vit": 12.5, "resnet-50": 3.0}, tmp_path / "b.png", "runtime", "s"),
        plot_fewshot({"m": ([1, 5, 10], [0.4, 0.6, 0.7], [0.05, 0.02, 0.01])}, tmp_path / "f.png", chance=1 / 3),
    ):
        assert f.stat().st_size > 1000


def test_mcnemar_exact():
    from scipy.stats import binomtest

    from vitlab.evaluate.metrics import mcnemar

    a = [1, 0, 0, 0, 0, 0, 1, 1]
    b = [0, 1, 1, 1, 1, 1, 1, 0]
    t = mcnemar(a, b)
    assert (t["only_a"], t["only_b"]) == (2, 5)
    assert t["p_value"] == pytest.approx(binomtest(2, 7, 0.5).pvalue)
    # 1 example only A gets right, 5 only B: p = 2 * (C(6,0) + C(6,1)) / 2^6 = 14/64
    t = mcnemar([1, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1])
    assert t["p_value"] == pytest.approx(14 / 64)
    assert mcnemar([1, 1], [1, 1])["p_value"] == 1.0
    rng = np.random.default_rng(0)
    x, y = rng.random(300) < 0.8, rng.random(300) < 0.7
    t = mcnemar(x, y)
    assert t["p_value"] == pytest.approx(binomtest(t["only_a"], t["only_a"] + t["only_b"], 0.5).pvalue)


@pytest.mark.parametrize("b,c", [(0, 0), (0, 1), (3, 3), (0, 5000), (2400, 2600), (2500, 2500), (1200, 3800),
                                 (1023, 1024), (4999, 1), (499_000, 501_000), (500_000, 500_000), (3, 999_997)])
def test_mcnemar_exact_for_any_number_of_discordant_pairs(b, c):
    # the direct sum C(n, i) / 2^n overflowed a float past ~1023 discordant pairs
    from scipy.stats import binomtest

    from vitlab.evaluate.metrics import binom_two_sided_half, mcnemar

    n = b + c
    expected = 1.0 if n == 0 else binomtest(b, n, 0.5).pvalue
    p = binom_two_sided_half(b, n)
    assert 0.0 <= p <= 1.0
    assert p == pytest.approx(expected, rel=1e-8, abs=1e-300)
    if n <= 10_000:  # through the test itself: b examples only A gets right, c only B
        a_right = np.r_[np.ones(b, bool), np.zeros(c, bool), np.ones(7, bool)]
        b_right = np.r_[np.zeros(b, bool), np.ones(c, bool), np.ones(7, bool)]
        t = mcnemar(a_right, b_right)
        assert (t["only_a"], t["only_b"]) == (b, c)
        assert t["p_value"] == pytest.approx(expected, rel=1e-8, abs=1e-300)


@pytest.mark.parametrize("name, lines", [
    ("vit-b/16", ["vit-b/16"]),
    ("custom(dim=16,depth=1,heads=2,mlp_dim=32)", ["custom(dim=16,", "depth=1,heads=2,", "mlp_dim=32)"]),
    ("hf:google/vit-base-patch16-224-in21k", ["hf:google/", "vit-base-patch16-224-in21k"]),
])
def test_bar_labels_break_between_parts_never_inside_one(name, lines):
    from vitlab.evaluate.plots import wrap_label

    assert wrap_label(name).split("\n") == lines


def test_a_count_matrix_has_whole_number_ticks_and_says_how_many_images(tmp_path, monkeypatch):
    """A small test set's colour bar read 0.5, 1.5, ... images, and the title did not give n."""
    import matplotlib.pyplot as plt

    from vitlab.evaluate import plots

    kept = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: kept.append(fig) or path)
    plot_confusion_matrix([[1, 2], [0, 3]], ["a", "b"], tmp_path / "cm.png")
    fig = kept[0]
    fig.canvas.draw()
    ticks = [t for t in fig.axes[1].get_yticks() if 0 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert fig.axes[0].get_title() == "confusion matrix (6 images)"
    plt.close(fig)
