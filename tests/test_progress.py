"""Progress bars with ETA on stderr for kNN, the probe, few-shot, feature extraction and inspection; silent
when quiet; and the probe's results unchanged by fitting each candidate C once."""

import warnings

import numpy as np
import pytest
import torch

from vitlab.evaluate.features import run_model
from vitlab.evaluate.fewshot import fewshot_eval
from vitlab.evaluate.knn import knn_scores
from vitlab.evaluate.probe import DEFAULT_CS, fit_probe
from vitlab.inspect import inspect_model
from vitlab.models.registry import create_model


@pytest.fixture(autouse=True)
def _every_step_drawn(monkeypatch):
    """Draw the bar at every step (the default redraws at most twice a second, every 30 s into a pipe such as
    pytest's capture), so the 100% line appears."""
    monkeypatch.setattr("vitlab.progress.MININTERVAL", 0.0)
    monkeypatch.setattr("vitlab.progress.LOG_MININTERVAL", 0.0)


def _blobs(n: int = 300, d: int = 8, k: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, n)
    x = rng.normal(size=(n, d)) + 1.5 * np.eye(k, d)[y]
    return x.astype(np.float32), y


def _has_bar(err: str, desc: str) -> bool:
    """A tqdm line: the description, a percentage, a count and the elapsed<remaining (ETA) field."""
    return desc in err and "100%" in err and "<" in err and "/s" in err


def test_knn_bar_counts_chunks_and_is_silent_when_off(capsys):
    x, y = _blobs()
    on = knn_scores(x, y, x[:50], 3, chunk=10, progress=True)
    err = capsys.readouterr().err
    assert _has_bar(err, "kNN") and "5/5 chunk" in err
    off = knn_scores(x, y, x[:50], 3, chunk=10, progress=False)
    assert capsys.readouterr().err == ""
    assert torch.equal(on, off)


def test_probe_bar_counts_fits_and_is_silent_when_off(capsys):
    x, y = _blobs()
    fit_probe(x[:200], y[:200], 3, x[200:], y[200:], progress=True)
    err = capsys.readouterr().err
    assert _has_bar(err, "linear probe") and f"{len(DEFAULT_CS)}/{len(DEFAULT_CS)} fit" in err and "C=" in err
    fit_probe(x[:200], y[:200], 3, x[200:], y[200:], progress=False)
    assert capsys.readouterr().err == ""


def _old_probe(x, y, vx, vy, cs=DEFAULT_CS, max_iter=1000, seed=0):
    """The probe before this change: choose C on validation, then refit on train with it."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    x = np.asarray(x, np.float64)
    mean, std = x.mean(0, keepdims=True), x.std(0, keepdims=True) + 1e-5
    z, zv = (x - mean) / std, (np.asarray(vx, np.float64) - mean) / std

    def fit(c):
        return LogisticRegression(C=c, max_iter=max_iter, tol=1e-6, random_state=seed).fit(z, y)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        accs = [(float((fit(c).predict(zv) == vy).mean()), -i, c) for i, c in enumerate(cs)]
        best = max(accs)[2]
        return best, fit(best), mean, std


@pytest.mark.parametrize("seed", [0, 1])
def test_probe_results_unchanged_without_the_refit(seed):
    x, y = _blobs(seed=seed)
    new = fit_probe(x[:200], y[:200], 3, x[200:], y[200:], seed=seed)
    c, model, mean, std = _old_probe(x[:200], y[:200], x[200:], y[200:], seed=seed)
    assert new.C == c
    assert np.array_equal(new.model.coef_, model.coef_) and np.array_equal(new.model.intercept_, model.intercept_)
    assert np.array_equal(new.scores(x), model.predict_proba((np.asarray(x, np.float64) - mean) / std))


def test_fewshot_bar_counts_shots_times_seeds(capsys):
    x, y = _blobs(n=200)
    res = fewshot_eval(x, y, x[:40], y[:40], 3, shots=(1, 2), seeds=2, progress=True)
    err = capsys.readouterr().err
    assert _has_bar(err, "few-shot") and "4/4 fit" in err
    again = fewshot_eval(x, y, x[:40], y[:40], 3, shots=(1, 2), seeds=2)
    assert capsys.readouterr().err == "" and again == res


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 20):
        g = torch.Generator().manual_seed(0)
        self.x = (torch.rand(n, 1, 8, 8, generator=g) * 255).to(torch.uint8)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], i % 3


class _Pre:
    def batch(self, x):
        return x.float() / 127.5 - 1.0


def _tiny(**kw):
    return create_model("custom", dim=16, depth=1, heads=2, mlp_dim=32, patch_size=4, image_size=8, in_chans=1,
                        num_classes=3, seed=0, **kw)


def test_feature_extraction_bar(capsys):
    run_model(_tiny(), _Data(), _Pre(), batch_size=8, want_features=True, progress=True, desc="test features")
    err = capsys.readouterr().err
    assert _has_bar(err, "test features") and "3/3 batch" in err
    run_model(_tiny(), _Data(), _Pre(), batch_size=8, want_features=True, progress=False)
    assert capsys.readouterr().err == ""


def test_inspect_bars_steps_and_attention(tmp_path, capsys):
    x = torch.randn(5, 1, 8, 8)
    inspect_model(_tiny(), x, tmp_path / "a", progress=True, batch_size=2, rollout_images=2)
    err = capsys.readouterr().err
    assert _has_bar(err, "inspect: analyses") and "5/5 step" in err
    assert "inspect: attention of 5 images" in err and "3/3 batch" in err
    inspect_model(_tiny(), x, tmp_path / "b", progress=False, batch_size=2, rollout_images=2)
    assert capsys.readouterr().err == ""


def test_evaluate_command_quiet_has_no_bars_and_loud_has_them(tmp_path, capsys):
    from vitlab.cli import main

    args = ["evaluate", "custom(dim=32,depth=1,heads=2,mlp_dim=64,patch_size=7)", "--data", "bundled",
            "--classes", "Sandal,Sneaker,Ankle boot", "--per-class", "10", "--knn", "--probe", "--fewshot",
            "--shots", "1", "--fewshot-seeds", "1", "--max-train-per-class", "8"]
    assert main([*args, "--out", str(tmp_path / "q"), "--quiet"]) == 0
    assert "%|" not in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "l")]) == 0
    err = capsys.readouterr().err
    for desc in ("kNN", "linear probe", "few-shot ridge", "train features"):
        assert desc in err, desc


def test_bars_redraw_rarely_into_a_file_or_a_pipe(monkeypatch, tmp_path):
    """On a terminal a bar redraws twice a second; into a log file or a pipe every 30 s, since each redraw stays
    in the file there."""
    import sys

    from vitlab import progress

    monkeypatch.undo()  # the module's own intervals, not the fixture's zeros
    with open(tmp_path / "log.txt", "w") as log:
        monkeypatch.setattr(sys, "stderr", log)
        assert progress.redraw_seconds() == progress.LOG_MININTERVAL == 30.0
        with progress.progress_bar(range(3), desc="x", unit="it") as bar:
            assert bar.mininterval == 30.0
        monkeypatch.setattr(log, "isatty", lambda: True, raising=False)
        assert progress.redraw_seconds() == progress.MININTERVAL == 0.5


@pytest.mark.parametrize("leave", [False, True])
def test_a_bar_into_a_log_writes_whole_lines(monkeypatch, leave):
    """Where stderr is a file or a pipe, each redraw is a line of its own: no carriage returns, no line of blanks
    where a finished bar was erased, and what is printed after the bar starts on a line of its own."""
    import io
    import sys

    from vitlab.progress import progress_bar

    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    for _ in progress_bar(range(3), desc="work", unit="item", leave=leave):
        pass
    print("next line", file=sys.stderr)
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[-1] == "next line" and all(line.strip() for line in lines)
    assert all(line.startswith("work: ") for line in lines[:-1]) and "3/3 item" in lines[-2]


def test_nested_bars_into_a_log_leave_no_cursor_moves(monkeypatch):
    """An inner bar (inspect's batches inside its analyses) moves the cursor up and back: escape codes in a log."""
    import io
    import sys

    from vitlab.progress import progress_bar

    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    with progress_bar(total=2, desc="outer", unit="step") as outer:
        for _ in progress_bar(range(3), desc="inner", unit="batch"):
            pass
        outer.update(2)
    text = log.getvalue()
    assert "\x1b" not in text and "\r" not in text and all(line.strip() for line in text.splitlines())


def test_a_short_bar_into_a_log_ends_with_its_final_state(monkeypatch):
    """Into a log a bar redraws every 30 s, so a bar that closes sooner kept only its first line ("test: 0%| 0/1
    batch"), which read as work that never finished: its final state is now written when it closes."""
    import io
    import sys

    from vitlab.progress import progress_bar

    monkeypatch.setattr("vitlab.progress.LOG_MININTERVAL", 30.0)
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    for _ in progress_bar(range(3), desc="test", unit="batch"):
        pass
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("test:   0%") and lines[-1].startswith("test: 100%") and "3/3 batch" in lines[-1]
