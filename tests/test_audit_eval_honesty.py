"""Audit of `vitlab evaluate`'s numbers against independent references (scikit-learn, numpy from the definitions).

Each test here (the T = 0.07 kNN case is a control) failed on the code before the audit's fix; the docstring says
what was wrong."""

import numpy as np
import pytest
import torch
from sklearn import metrics as skm

from vitlab.data import Preprocess, load_data
from vitlab.errors import VitlabError
from vitlab.evaluate.features import run_model
from vitlab.evaluate.fewshot import fewshot_eval
from vitlab.evaluate.knn import knn_scores
from vitlab.evaluate.metrics import classification_metrics, topk_accuracy
from vitlab.evaluate.runner import FrozenOptions, evaluate_model
from vitlab.evaluate.zeroshot import parse_class_map
from vitlab.models import create_model

TINY = dict(dim=32, depth=1, heads=2, mlp_dim=64, patch_size=7, image_size=28, in_chans=1)
CLASSES = ["Sandal", "Sneaker", "Ankle boot"]


@pytest.fixture(scope="module")
def data():
    return load_data("bundled", classes=",".join(CLASSES), per_class=10, progress=False)


def _knn_reference(train_x, train_y, test_x, num_classes, k, temperature):
    """DINO's vote written from the definition in float64: cosine, top k, weight exp(s / T), summed per class."""
    tr = train_x / np.linalg.norm(train_x, axis=1, keepdims=True)
    te = test_x / np.linalg.norm(test_x, axis=1, keepdims=True)
    sim = te @ tr.T
    pred = []
    for row in sim:
        top = np.argsort(-row, kind="stable")[:k]
        logw = row[top] / temperature
        w = np.exp(logw - logw.max())  # the ratio of the weights is all the vote needs
        pred.append(np.bincount(train_y[top], weights=w, minlength=num_classes).argmax())
    return np.array(pred)


@pytest.mark.parametrize("temperature", [0.07, 0.01, 0.005, 0.001])
def test_knn_small_temperatures_do_not_overflow(temperature):
    """exp(s / T) overflowed float32 for T below ~0.011: every class with a neighbour scored inf and argmax gave the
    lowest such class index, silently."""
    rng = np.random.default_rng(0)
    tr = rng.normal(size=(60, 8)).astype(np.float32)
    ytr = np.arange(60) % 3
    te = (tr[:20] + 0.05 * rng.normal(size=(20, 8))).astype(np.float32)
    scores = knn_scores(tr, ytr, te, 3, k=10, temperature=temperature)
    assert torch.isfinite(scores).all()
    ref = _knn_reference(tr.astype(np.float64), ytr, te.astype(np.float64), 3, 10, temperature)
    assert np.array_equal(scores.argmax(1).numpy(), ref)


def test_topk_ties_agree_with_argmax():
    """torch.topk breaks ties arbitrarily: an example whose true class won the argmax (top-1 correct) could be missing
    from its top 5, so top-5 < accuracy. Ties are now broken like argmax (lower class index first)."""
    rng = np.random.default_rng(0)
    k = 8
    logits = torch.tensor(rng.integers(0, 2, (300, k)).astype(np.float32))  # many ties
    y = rng.integers(0, k, 300)
    acc = float((logits.argmax(1).numpy() == y).mean())
    assert topk_accuracy(logits, y, 1) == pytest.approx(acc)
    top1 = logits.argmax(1).numpy() == y
    # reference: a stable descending order (lower index first among equal scores)
    order = np.argsort(-logits.numpy(), axis=1, kind="stable")[:, :5]
    ref = (order == y[:, None]).any(axis=1)
    assert topk_accuracy(logits, y, 5) == pytest.approx(ref.mean())
    assert not (top1 & ~ref).any()
    # without ties it is scikit-learn's top_k_accuracy_score
    untied = torch.tensor(rng.normal(size=(300, k)).astype(np.float32))
    assert topk_accuracy(untied, y, 5) == pytest.approx(skm.top_k_accuracy_score(y, untied.numpy(), k=5,
                                                                               labels=range(k)))
    m = classification_metrics(y, logits.argmax(1).numpy(), k, logits=logits)
    assert m["top5"] >= m["accuracy"]


def test_fresh_head_frozen_features_keep_the_representation_layer(data):
    """With a representation layer (the paper's pre-logits, e.g. the ImageNet-21k checkpoints) and a head that did
    not fit the data, the test features came from the fresh-head copy, which had dropped that layer, while the
    training features came from the model with it: few-shot / kNN / probe compared two different features and sat
    at chance. The frozen numbers must equal those of the model's own pre-logits on both splits."""
    pre = Preprocess.for_model(28, channels=1)
    model = create_model("custom", num_classes=10, representation_size=32, seed=1, **TINY)
    with torch.no_grad():
        model.pre_logits.fc.weight.normal_(0, 1.0)
    res = evaluate_model(model, data, pre, frozen=FrozenOptions(fewshot=True, knn=True, shots=(1, 5),
                                                                fewshot_seeds=2), progress=False)
    assert res.head_mode == "fresh"
    te = run_model(model, data.test, pre, want_logits=False, want_features=True, progress=False)
    tr = run_model(model, data.train, pre, want_logits=False, want_features=True, progress=False)
    ref = fewshot_eval(tr.features, tr.labels, te.features, te.labels, 3, (1, 5), 2)
    assert [r["accuracy_per_seed"] for r in res.fewshot["results"]] == [r["accuracy_per_seed"] for r in ref["results"]]
    knn_ref = _knn_reference(tr.features.astype(np.float64), tr.labels, te.features.astype(np.float64), 3, 20, 0.07)
    assert res.knn["accuracy"] == pytest.approx(float((knn_ref == te.labels).mean()))


def test_frozen_analyses_on_the_train_split_are_refused(data):
    """`--split train --knn` scored training images against themselves (each is its own nearest neighbour: 64% where
    the test split gave 33%); few-shot and the probe train on that split too."""
    model = create_model("custom", num_classes=3, seed=1, **TINY)
    pre = Preprocess.for_model(28, channels=1)
    for frozen in (FrozenOptions(knn=True), FrozenOptions(fewshot=True), FrozenOptions(probe=True)):
        with pytest.raises(VitlabError, match="train split"):
            evaluate_model(model, data, pre, split="train", frozen=frozen, progress=False)
    evaluate_model(model, data, pre, split="train", progress=False)  # the head alone may be scored on it


def test_probe_never_picks_c_on_the_split_it_is_scored_on(data):
    """With `--split val` the probe chose C by accuracy on the validation images and then reported its accuracy on
    the same images: a hyper-parameter picked on the evaluated split."""
    model = create_model("custom", num_classes=3, seed=1, **TINY)
    pre = Preprocess.for_model(28, channels=1)
    res = evaluate_model(model, data, pre, split="val", frozen=FrozenOptions(probe=True), progress=False)
    assert res.probe["C_chosen_on"] != "val" and res.probe["C"] == 1.0
    assert "default" in res.rows[-1]["note"]
    res = evaluate_model(model, data, pre, split="test", frozen=FrozenOptions(probe=True), progress=False)
    assert res.probe["C_chosen_on"] == "val"


@pytest.mark.parametrize("spec, words", [
    ("Sandal=774,Sneaker=774,Ankle boot=514", "head class 774"),  # Sneaker would tie with Sandal and never win
    ("Sandal=774+630,Sneaker=770+630,Ankle boot=514", "head class 630"),  # 630's probability counted for both
    ("Sandal=774+774,Sneaker=770,Ankle boot=514", "head class 774"),  # counted twice for Sandal
])
def test_a_head_class_in_two_places_of_a_map_is_refused(spec, words):
    """A head class mapped to two data classes (or twice to one) was accepted: with one class each, the two data
    classes always tied and the later one was never predicted."""
    with pytest.raises(VitlabError, match=words):
        parse_class_map(spec, CLASSES, 1000)


def test_head_flags_and_a_map_that_contradict_are_one_line_and_mapped_works_by_name():
    """`--head fresh` silently ignored --zero-shot-map and `--head trained` silently evaluated through it; `--head
    mapped` without a map was refused although the data's classes were among the model's (auto maps those by name)."""
    from vitlab.evaluate.runner import choose_head_mode

    m4 = create_model("custom", num_classes=4, seed=0, **TINY)
    for head in ("fresh", "trained"):
        with pytest.raises(VitlabError, match=f"--head {head}"):
            choose_head_mode(m4, ["a", "b"], None, zero_shot_map="a=0,b=1", head=head)
    assert choose_head_mode(m4, ["a", "b"], ["x", "a", "b", "y"], head="mapped") == ("mapped", [[1], [2]])
    assert choose_head_mode(m4, ["a", "b"], None, zero_shot_map="a=0,b=1", head="mapped") == ("mapped", [[0], [1]])
    with pytest.raises(VitlabError, match="--zero-shot-map"):
        choose_head_mode(m4, ["a", "q"], ["x", "a", "b", "y"], head="mapped")


def test_a_probe_that_stopped_at_the_iteration_cap_says_so(data, monkeypatch):
    """L-BFGS's ConvergenceWarning was swallowed: a probe cut off at max_iter was reported like a converged one."""
    from vitlab.evaluate import probe as probe_mod

    rng = np.random.default_rng(0)
    x = rng.normal(size=(90, 6))
    y = np.arange(90) % 3
    assert probe_mod.fit_probe(x, y, 3).converged
    assert not probe_mod.fit_probe(x, y, 3, max_iter=1).converged
    import functools

    monkeypatch.setattr(probe_mod, "fit_probe", functools.partial(probe_mod.fit_probe, max_iter=1))
    model = create_model("custom", num_classes=3, seed=1, **TINY)
    res = evaluate_model(model, data, Preprocess.for_model(28, channels=1), frozen=FrozenOptions(probe=True),
                         progress=False)
    assert res.probe["converged"] is False and "not converged" in res.rows[-1]["note"]


def test_a_map_for_a_model_built_from_a_name_is_one_line(tmp_path, capsys):
    """`vitlab evaluate custom(...) --zero-shot-map ...` dropped the map without a word (a random model has no
    pretrained head); `compare`, which gives one map to all its models, still ignores it for those."""
    from vitlab.cli import main

    args = ["evaluate", "custom(dim=32,depth=1,heads=2,patch_size=7)", "--data", "bundled", "--per-class", "5",
            "--quiet", "--zero-shot-map", "0=1", "--out", str(tmp_path / "ev")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no pretrained head" in err[0]
    model = create_model("custom", num_classes=10, seed=1, **TINY)
    data = load_data("bundled", per_class=5, progress=False)
    res = evaluate_model(model, data, Preprocess.for_model(28, channels=1), zero_shot_map="0=1", untrained=True,
                         progress=False)
    assert res.head_mode == "fresh"


def test_a_probe_on_one_class_and_repeated_shots_are_one_line(tmp_path, capsys):
    """A probe on training features of one class ended in scikit-learn's ValueError ("an unexpected failure ...
    please report it"); `--shots 5,5` ran the same evaluation twice and printed two identical rows."""
    from vitlab.cli import main
    from vitlab.evaluate.probe import fit_probe

    with pytest.raises(VitlabError, match="at least 2 classes"):
        fit_probe(np.random.default_rng(0).normal(size=(6, 4)), np.zeros(6, np.int64), 3)
    spec = "custom(dim=32,depth=1,heads=2,patch_size=7)"
    assert main(["evaluate", spec, "--data", "bundled", "--classes", "Sandal", "--per-class", "5", "--probe",
                 "--quiet", "--out", str(tmp_path / "ev")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "at least 2 classes" in err[0] and "unexpected" not in err[0]
    with pytest.raises(SystemExit) as exc:  # an argparse error: one line, exit 2
        main(["evaluate", spec, "--data", "bundled", "--per-class", "5", "--fewshot", "--shots", "5,1,5", "--quiet",
              "--out", str(tmp_path / "ev")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "5 twice" in err[0]


def test_frozen_features_never_pair_a_substituted_image_with_another_rows_label(tmp_path, capsys):
    """A streamed training split replaces an unreadable file by the next readable one (there: the first image of
    the next class), while few-shot, kNN and the probe paired each row's features with the row's own label: the
    substitute entered as the wrong class. The frozen evaluations now leave unreadable files out, and say so."""
    from PIL import Image

    from vitlab.evaluate.runner import _without_substitutes

    for c, cls in enumerate(("a", "b")):
        (tmp_path / "train" / cls).mkdir(parents=True)
        (tmp_path / "test" / cls).mkdir(parents=True)
        for i in range(3):
            Image.new("L", (8, 8), 40 + 160 * c + i).save(tmp_path / "train" / cls / f"{i}.png")
            Image.new("L", (8, 8), 40 + 160 * c + i).save(tmp_path / "test" / cls / f"{i}.png")
    noise = np.random.default_rng(0).integers(0, 255, (64, 64), dtype=np.uint8)
    Image.fromarray(noise).save(tmp_path / "whole.png")
    whole = (tmp_path / "whole.png").read_bytes()  # its header reads (the load's check passes), its pixels do not:
    (tmp_path / "train" / "a" / "9.png").write_bytes(whole[: len(whole) // 2])  # the last row of class a
    d = load_data(str(tmp_path), in_memory=False, val_fraction=0, progress=False, report=False)
    assert d.train.substitute and len(d.train) == 7
    bad_row = d.train.paths.index(str(tmp_path / "train" / "a" / "9.png"))
    image, label = d.train[bad_row]  # training's substitute: the next row's image and label
    assert label == 1 and int(d.train.labels[bad_row]) == 0
    kept = _without_substitutes(d.train, progress=False)
    assert len(kept) == 6 and not kept.substitute and d.train.substitute  # the run's own split is untouched
    assert all(int(y) == ("/b/" in p) for p, y in zip(kept.paths, kept.labels))
    model = create_model("custom", **{**TINY, "image_size": 8, "patch_size": 4}, num_classes=2, seed=0)
    evaluate_model(model, d, Preprocess.for_model(8, channels=1), frozen=FrozenOptions(knn=True, knn_k=3),
                   progress=False)
    assert "1 unreadable training image left out of the frozen-feature evaluations" in capsys.readouterr().err


def test_fewshot_spread_over_seeds_is_the_sample_std():
    from vitlab.evaluate.fewshot import fewshot_eval

    rng = np.random.default_rng(0)
    train_y = np.repeat(np.arange(3), 20)
    train_x = rng.normal(size=(60, 8)) + train_y[:, None]
    test_y = np.repeat(np.arange(3), 10)
    test_x = rng.normal(size=(30, 8)) + test_y[:, None]
    res = fewshot_eval(train_x, train_y, test_x, test_y, 3, shots=[1, 2], seeds=4)["results"]
    for r in res:
        assert r["std"] == pytest.approx(np.std(r["accuracy_per_seed"], ddof=1))
    assert any(len(set(r["accuracy_per_seed"])) > 1 for r in res)  # a spread to tell the two stds apart
    one = fewshot_eval(train_x, train_y, test_x, test_y, 3, shots=[1], seeds=1)["results"][0]
    assert one["std"] == 0.0
