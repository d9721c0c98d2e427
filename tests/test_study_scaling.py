"""`vitlab study scaling` on the bundled data with tiny models; nested subsets; resume; refused settings."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from vitlab.cli import main
from vitlab.data.splits import nested_order, nested_subset
from vitlab.errors import VitlabError
from vitlab.experiments import scaling
from vitlab.experiments.scaling import ScalingSettings, run_scaling_study

TINY_VIT = "custom(dim=16,depth=1,heads=2,mlp_dim=32,patch_size=7)"
TINY_RESNET = "resnet-18-small(base_width=8,layers=(1,1))"


def _settings(**kw) -> ScalingSettings:
    # bundled: 4,500 training images after the 500-image validation split; 9,999 is capped to those
    base = dict(data="bundled", models=[TINY_VIT, TINY_RESNET], sizes=[100, 9999], seeds=2, multi_seed_max=100,
                min_epochs=0.25, min_steps=6, batch_size=32, evals=2, quiet=True)
    base.update(kw)
    return ScalingSettings(**base)


def test_nested_subsets_are_nested_and_stratified():
    rng = np.random.default_rng(3)
    labels = np.repeat(np.arange(4), [300, 300, 200, 100])  # unbalanced: shares 0.3/0.3/0.2/0.1
    labels = labels[rng.permutation(len(labels))]
    shares = np.bincount(labels) / len(labels)
    previous = np.zeros(0, dtype=np.int64)
    for n in (10, 37, 100, 333, 900, 1000, 5000):
        idx = nested_subset(labels, n, seed=7)
        assert len(idx) == min(n, len(labels)) and len(np.unique(idx)) == len(idx)
        assert set(previous) <= set(idx)  # the smaller subset lies inside the larger
        counts = np.bincount(labels[idx], minlength=4)
        assert np.all(np.abs(counts - len(idx) * shares) <= 1.0), (n, counts)
        previous = idx
    # balanced classes and a multiple of K: exactly n / K per class
    balanced = np.tile(np.arange(10), 50)
    assert np.bincount(balanced[nested_subset(balanced, 100, seed=1)]).tolist() == [10] * 10
    # the seed re-draws the order; the same seed gives the same order
    assert np.array_equal(nested_order(labels, 7), nested_order(labels, 7))
    assert not np.array_equal(nested_subset(labels, 100, 7), nested_subset(labels, 100, 8))
    with pytest.raises(VitlabError):
        nested_subset(labels, 0)


def test_t_quantiles_match_scipy():
    from scipy import stats

    for df in (1, 2, 5, 30, 31, 40, 64, 200, 10_000):  # past the table's 30 the normal's 1.96 was 0.08 short
        assert scaling.t_quantile(df) == pytest.approx(stats.t.ppf(0.975, df), rel=1e-5)
    m, lo, hi = scaling.mean_interval([0.8, 0.82, 0.84])
    assert m == pytest.approx(0.82) and hi - m == pytest.approx(stats.t.ppf(0.975, 2) * 0.02 / np.sqrt(3))


def test_study_end_to_end_then_resume_skips_finished_runs(tmp_path, monkeypatch, capsys):
    out = tmp_path / "study"
    rows = run_scaling_study(_settings(), out)
    for f in ("study.md", "study.csv", "study.json", "study.png", "settings.json"):
        assert (out / f).exists(), f
    assert [(r["model"], r["size"], r["seeds"]) for r in rows] == [
        (TINY_VIT, 100, 2), (TINY_VIT, 4500, 1), (TINY_RESNET, 100, 2), (TINY_RESNET, 4500, 1)]
    with (out / "study.csv").open() as fh:
        assert len(list(csv.DictReader(fh))) == 4
    runs = json.loads((out / "study.json").read_text())["runs"]
    assert len(runs) == 6 and len(list((out / "runs").iterdir())) == 6
    for r in rows:
        assert 0.0 <= r["test_accuracy"] <= 1.0
        lo, hi = r["test_accuracy_ci95"]
        assert lo <= r["test_accuracy"] <= hi
        assert r["ci_method"] == ("wilson" if r["seeds"] == 1 else "t, 2 seeds")
        # the budget rule: max(6 steps, ceil(0.25 epochs x size / 32))
        assert r["steps"] == max(6, -(-r["size"] // 128)) and r["images_seen"] == 32 * r["steps"]
        assert r["parameters"] > 0 and r["mmacs"] > 0
    assert rows[1]["capped"] and rows[1]["requested_size"] == "9999"
    md = (out / "study.md").read_text()
    assert "all remaining after the 500-image validation split" in md and "t, 2 seeds" in md
    threads = json.loads((out / "settings.json").read_text())["threads"]
    assert f"CPU threads: {threads} for every run" in md  # what reproduces the numbers
    assert {r["threads"] for r in runs} == {threads}
    for run in runs:  # every run is evaluated on the same full test set; its row points at its folder
        assert run["test_n"] == 1000
        assert (out / run["run"] / "summary.json").exists() and (out / run["run"] / "scaling.json").exists()
    # the best-checkpoint test pass is the training's own: the final weights give the summary's accuracy
    from vitlab.data import load_data
    from vitlab.weights import load

    data = load_data("bundled", val_fraction=0.1, seed=0, progress=False)
    run = out / runs[0]["run"]
    summary = json.loads((run / "summary.json").read_text())
    again_tm = scaling._test_metrics(run, load(run / "model").state_dict(), data, summary)
    assert again_tm["accuracy"] == summary["test_accuracy"] and again_tm["n"] == 1000
    progress = capsys.readouterr().out
    assert progress.count("test acc") == 6 and "size 4,500 seed 0" in progress

    # a killed study: one finished run loses its scaling.json (as if killed during the test pass),
    # another loses everything; only the latter may train again, exactly once
    first = out / runs[0]["run"]
    (first / "scaling.json").unlink()
    import shutil

    shutil.rmtree(out / runs[-1]["run"])
    calls = []
    from vitlab import train as train_pkg

    real_train = train_pkg.train

    def train_once(*a, **k):
        calls.append(1)
        if len(calls) > 1:
            raise AssertionError("a finished run was trained again")
        return real_train(*a, **k)

    monkeypatch.setattr("vitlab.train.train", train_once)
    again = run_scaling_study(_settings(), out)
    assert len(calls) == 1
    assert [r["test_accuracy"] for r in again[:2]] == [r["test_accuracy"] for r in rows[:2]]
    assert "done before" in capsys.readouterr().out


def test_interrupted_run_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """A run with step checkpoints but no summary goes back to training with resume= its folder."""
    st = _settings(models=[TINY_VIT], sizes=[100], seeds=1)
    run = tmp_path / "runs" / "x"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step-0000004.pt").write_bytes(b"")
    seen = {}

    def fake_train(cfg, data=None, model=None):
        seen["resume"], seen["n"] = cfg.resume, len(data.train)

    monkeypatch.setattr("vitlab.train.train", fake_train)
    from vitlab.data import load_data

    data = load_data("bundled", val_fraction=0.1, seed=0, progress=False)
    scaling.train_run(TINY_VIT, 100, 0, data, st, run)
    assert seen == {"resume": str(run), "n": 100}
    (run / "checkpoints" / "step-0000004.pt").unlink()  # no checkpoint: a clean restart, the folder goes
    (run / "checkpoints" / "step-0000004.pt.bak").write_bytes(b"")  # named like one, but not a checkpoint
    (run / "metrics.jsonl").write_text("stale\n")
    scaling.train_run(TINY_VIT, 100, 0, data, st, run)
    assert seen["resume"] is None and not (run / "metrics.jsonl").exists()


def test_refuses_changed_settings(tmp_path):
    out = tmp_path / "study"
    out.mkdir()
    (out / "settings.json").write_text(json.dumps({"lr": 1.0, "sizes": [5]}))
    with pytest.raises(VitlabError, match=r"other settings \(lr\)"):
        run_scaling_study(_settings(), out)
    with pytest.raises(VitlabError, match="smaller than --batch-size"):
        run_scaling_study(_settings(sizes=[10, 100]), tmp_path / "other")
    # a failed start (unknown model) records nothing, so the corrected command is not refused
    with pytest.raises(VitlabError, match="unknown model"):
        run_scaling_study(_settings(models=["no-such-model"]), tmp_path / "typo")
    assert not (tmp_path / "typo" / "settings.json").exists()


def test_cli_one_line_errors(tmp_path, capsys):
    assert main(["study", "scaling", "--data", "bundled", "--sizes", "0,100", "--out", str(tmp_path / "s")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sizes" in err[0]


LONG_A = "custom(dim=16,depth=1,heads=2,mlp_dim=32,classifier=token,patch_size=7)"
LONG_B = "custom(dim=16,depth=1,heads=2,mlp_dim=32,classifier=token,patch_size=4)"  # same 60-char slug start


def test_long_specs_get_their_own_run_folders(tmp_path):
    """Two specs cut to the same 60 characters shared a run folder: B read A's result, then an IndexError."""
    out = tmp_path / "study"
    rows = run_scaling_study(_settings(models=[LONG_A, LONG_B], sizes=[100], seeds=1), out)
    assert [r["model"] for r in rows] == [LONG_A, LONG_B]
    runs = json.loads((out / "study.json").read_text())["runs"]
    assert len({r["run"] for r in runs}) == 2 and len(list((out / "runs").iterdir())) == 2
    assert rows[0]["mmacs"] < rows[1]["mmacs"]  # 16 and 49 tokens: two different models ran
    assert runs[0]["test_accuracy"] != runs[1]["test_accuracy"]  # and B did not read back A's result


def test_spec_image_size_is_honoured_and_num_classes_refused(tmp_path):
    """image_size= in a spec crashed (given twice to the build); it is the size the model is built and trained at."""
    spec = "custom(dim=16,depth=1,heads=2,mlp_dim=32,patch_size=5,image_size=30)"
    out = tmp_path / "study"
    rows = run_scaling_study(_settings(models=[spec], sizes=[100], seeds=1), out)
    assert len(rows) == 1 and "image_size=30" in rows[0]["spec"]
    runs = json.loads((out / "study.json").read_text())["runs"]
    config = json.loads((out / runs[0]["run"] / "model" / "config.json").read_text())
    assert list(config["model"]["image_size"]) == [30, 30]
    for bad, match in (("custom(dim=16,depth=1,heads=2,patch_size=7,num_classes=3)", "num_classes is decided by"),
                       ("custom(dim=16,depth=1,heads=2,patch_size=5)", "not a multiple"),
                       ("custom(dim=16,depth=1,heads=2", r"no closing '\)'")):
        with pytest.raises(VitlabError, match=match):
            run_scaling_study(_settings(models=[bad]), tmp_path / "bad")
        assert not (tmp_path / "bad").exists()  # a failed start writes nothing, not even the folder


def test_refuses_duplicate_models(tmp_path):
    """`--models X,X` counted one seed's run twice: two rows, each '2 seeds' with a zero-width interval."""
    with pytest.raises(VitlabError, match="twice"):
        run_scaling_study(_settings(models=[TINY_VIT, TINY_RESNET, TINY_VIT]), tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_refuses_one_class(tmp_path):
    from PIL import Image

    folder = tmp_path / "data" / "cat"
    folder.mkdir(parents=True)
    for i in range(40):
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (12, 12), dtype=np.uint8)).save(folder / f"{i}.png")
    with pytest.raises(VitlabError, match="one class"):
        run_scaling_study(_settings(data=str(tmp_path / "data"), models=[TINY_RESNET], sizes=[10], batch_size=8),
                          tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_refuses_other_data_and_decides_threads_once(tmp_path, monkeypatch):
    """The data's fingerprint and the thread count are recorded; a rerun uses the count, refuses other data."""
    import torch

    class Stop(Exception):
        pass

    seen = []

    def fake_train(cfg, data=None, model=None):
        seen.append(cfg.threads)
        raise Stop

    monkeypatch.setattr("vitlab.train.train", fake_train)
    monkeypatch.setattr("vitlab.runtime.choose_threads", lambda requested: (3, "auto: test"))
    threads_before = torch.get_num_threads()
    out = tmp_path / "study"
    try:
        with pytest.raises(Stop):
            run_scaling_study(_settings(threads=1), out)
        recorded = json.loads((out / "settings.json").read_text())
        assert recorded["threads"] == 1 and seen == [1]
        assert recorded["data_identity"] == {
            "classes": ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                        "Ankle boot"], "images": {"train": 4500, "val": 500, "test": 1000}}
        with pytest.raises(Stop):  # no --threads: the recorded count, not the automatic one (3)
            run_scaling_study(_settings(), out)
        assert seen == [1, 1]
        with pytest.raises(VitlabError, match=r"other settings \(threads\)"):
            run_scaling_study(_settings(threads=2), out)
        recorded["data_identity"]["images"]["test"] = 900  # as if the data on disk had changed since
        (out / "settings.json").write_text(json.dumps(recorded))
        with pytest.raises(VitlabError, match="other data .*test 900 -> 1000"):
            run_scaling_study(_settings(), out)
        with pytest.raises(Stop):  # a new study without --threads: decided once, automatically
            run_scaling_study(_settings(), tmp_path / "auto")
        assert seen[-1] == 3 and json.loads((tmp_path / "auto" / "settings.json").read_text())["threads"] == 3
    finally:
        torch.set_num_threads(threads_before)
