"""Run tracking (issue 19, item 4): `--logger tensorboard` event files and `--logger wandb` (offline) runs that
hold what metrics.jsonl holds, the final metrics and the figures; a resume appends without repeating steps."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_train_loop import tiny_data  # the three-class 8x8 set shared by the training tests
from vitlab.errors import VitlabError
from vitlab.train import loop, resolve_config, train
from vitlab.train.loggers import WANDB_ID_FILE, open_trackers, parse_logger, scalars_of
from vitlab.train.run_dir import read_metrics

CLASSES = ["a", "b", "c"]
STEPS = 6  # 48 images / batch 16 = 3 steps an epoch, 2 epochs
STEP_TAGS = {"loss": "train/loss", "lr": "train/lr", "images_per_s": "train/images_per_s",
             "grad_norm": "train/grad_norm", "epoch_float": "train/epoch"}
EPOCH_TAGS = {"train_loss": "epoch/train_loss", "train_acc": "epoch/train_acc", "lr": "epoch/lr",
              "time_s": "epoch/time_s", "val_loss": "val/loss", "val_acc": "val/acc", "val_macro_f1": "val/macro_f1"}
FIGURES = {"figures/loss", "figures/accuracy", "figures/confusion_matrix"}


def tiny_cfg(tmp_path, **kw):
    base = dict(data="tiny", model="custom", out_dir=str(tmp_path), name="run", deterministic=True, threads=1,
                model_args=dict(dim=16, depth=1, heads=2, mlp_dim=32, patch_size=4), epochs=2, batch_size=16,
                warmup_steps=1, quiet=True, log_every=1, inception_crop=False, eval_batch_size=24, ckpt_every=0,
                save_model=False)
    base.update(kw)
    return resolve_config("small-data", overrides=base)


pytestmark = pytest.mark.usefixtures("keep_torch_threads")  # tests/conftest.py


def crash_at_step(tmp_path, monkeypatch, step: int, **kw) -> Path:
    """A run that dies during step `step` (after the epoch-end checkpoint at step 3): steps after the checkpoint
    were already tracked and will be redone by the resume."""
    real, calls = loop.params_finite, {"n": 0}

    def dies(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == step:
            raise RuntimeError("simulated crash")
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(loop, "params_finite", dies)
        with pytest.raises(RuntimeError, match="simulated crash"):
            train(tiny_cfg(tmp_path, **kw), data=tiny_data())
    return tmp_path / "run"


def resume(run: Path, **kw):
    """What `vitlab train --resume RUN [flags]` runs."""
    return train(resolve_config(None, run / "config.yaml", dict(kw, resume=str(run))), data=tiny_data())


def expected_scalars(run: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} from metrics.jsonl and summary.json (the final test metrics)."""
    out: dict[str, dict[int, float]] = {}
    for r in read_metrics(run):
        tags = STEP_TAGS if r["type"] == "step" else EPOCH_TAGS if r["type"] == "epoch" else {}
        for key, tag in tags.items():
            if r.get(key) is not None:
                out.setdefault(tag, {})[r["step"]] = r[key]
    test = json.loads((run / "summary.json").read_text())["test_metrics"]
    for key in ("accuracy", "macro_f1", "macro_precision", "macro_recall", "weighted_f1", "loss"):
        out[f"test/{key}"] = {STEPS: test[key]}
    return out


def event_accumulator(run: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def assert_events_match_metrics(run: Path) -> None:
    """Every scalar tag holds exactly the metrics.jsonl series (one event per step), the figures are images."""
    acc = event_accumulator(run)
    expected = expected_scalars(run)
    assert set(acc.Tags()["scalars"]) == set(expected)
    for tag, series in expected.items():
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert steps == sorted(series), f"{tag}: steps {steps}"  # no step twice, none missing
        assert [e.value for e in events] == pytest.approx([series[s] for s in steps], rel=1e-6), tag
    assert set(acc.Tags()["images"]) == FIGURES
    import matplotlib.image

    for tag in FIGURES:
        (image,) = acc.Images(tag)
        height, width = matplotlib.image.imread(run / f"{tag.split('/')[1]}.png").shape[:2]
        assert (image.step, image.width, image.height) == (STEPS, width, height)


# ----------------------------------------------------------------------------------------- the flag
def test_logger_values_are_canonical_and_typos_are_one_line():
    assert parse_logger(" TensorBoard, wandb ,tensorboard") == "tensorboard,wandb"
    assert parse_logger(["wandb"]) == "wandb"
    assert parse_logger("none") == parse_logger("jsonl") == parse_logger("") == "none"
    assert resolve_config("small-data", overrides={"logger": "Tensorboard"}).logger == "tensorboard"
    with pytest.raises(VitlabError, match="logger must be none, tensorboard, wandb .*got 'tensorbord'"):
        resolve_config("small-data", overrides={"logger": "tensorbord"})


def test_records_become_tagged_scalars_and_only_rank_0_tracks(tmp_path):
    step = {"type": "step", "step": 7, "epoch": 0, "epoch_float": 0.5, "loss": 2.5, "lr": 1e-3, "grad_norm": None,
            "images_per_s": 100.0}
    assert scalars_of(step) == {"train/loss": 2.5, "train/lr": 1e-3, "train/images_per_s": 100.0, "train/epoch": 0.5}
    epoch = {"type": "epoch", "epoch": 1, "step": 7, "train_loss": 2.0, "train_acc": 0.5, "lr": 1e-4, "time_s": 3.0,
             "val_loss": 1.5, "val_acc": 0.6, "val_macro_f1": 0.55, "val_top5": 0.9}
    assert scalars_of(epoch) == {"epoch/train_loss": 2.0, "epoch/train_acc": 0.5, "epoch/lr": 1e-4,
                                 "epoch/time_s": 3.0, "val/loss": 1.5, "val/acc": 0.6, "val/macro_f1": 0.55,
                                 "val/top5": 0.9}
    assert scalars_of({"type": "change", "step": 7, "changed": {"threads": [2, 1]}}) == {}
    assert open_trackers("tensorboard,wandb", tmp_path, {}, None, main=False).trackers == []
    assert list(tmp_path.iterdir()) == []  # other ranks open nothing


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_missing_package_is_named_before_the_run_starts(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # importlib.util.find_spec now reports it missing
    with pytest.raises(VitlabError, match=rf"--logger {name} needs the {name} package.*pip install 'vitlab\[{name}\]'"):
        train(tiny_cfg(tmp_path, logger=name), data=tiny_data())
    assert not (tmp_path / "run").exists()  # nothing started


# ---------------------------------------------------------------------------------------- TensorBoard
def test_tensorboard_events_hold_the_metrics_and_the_figures(tmp_path):
    pytest.importorskip("tensorboard")
    result = train(tiny_cfg(tmp_path, logger="tensorboard"), data=tiny_data())
    run = result.run_dir
    assert (run / "metrics.jsonl").is_file()  # written whatever the logger
    assert_events_match_metrics(run)
    acc = event_accumulator(run)
    assert len(acc.Scalars("train/loss")) == STEPS
    assert [e.step for e in acc.Scalars("val/acc")] == [3, 6]
    assert acc.Scalars("test/accuracy")[0].value == pytest.approx(result.test_metrics["accuracy"])
    assert "config/text_summary" in acc.Tags()["tensors"]  # the resolved config as text


def test_tensorboard_resume_continues_the_events_without_repeating_steps(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    run = crash_at_step(tmp_path, monkeypatch, step=5, logger="tensorboard")
    acc = event_accumulator(run)
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]  # step 4 is after the checkpoint (3)
    resume(run)  # the run's config.yaml keeps the logger
    assert_events_match_metrics(run)
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2


# -------------------------------------------------------------------------------------- Weights & Biases
@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for key in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_NAME"):
        monkeypatch.delenv(key, raising=False)
    home = tmp_path / "wandb-home"
    for key, sub in (("WANDB_DIR", "dir"), ("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"),
                     ("WANDB_DATA_DIR", "data"), ("WANDB_ARTIFACT_DIR", "artifacts")):
        monkeypatch.setenv(key, str(home / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def wandb_records(run_file: Path) -> list[dict]:
    """The records of an offline run's .wandb log, read by wandb's own reader (`wandb leet inspect --json`)."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    if out.returncode != 0 and "No such command" in out.stderr:
        pytest.skip("this wandb has no `wandb leet inspect` (wandb >= 0.31 reads its .wandb logs)")
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def wandb_history(records: list[dict]) -> dict[int, dict]:
    return {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}


def offline_run_files(run: Path, run_id: str) -> list[Path]:
    return sorted((run / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))


def test_wandb_offline_run_holds_the_history_config_and_figures(wandb_offline):
    run = train(tiny_cfg(wandb_offline, logger="wandb"), data=tiny_data()).run_dir
    run_id = (run / WANDB_ID_FILE).read_text().strip()
    (run_file,) = offline_run_files(run, run_id)
    records = wandb_records(run_file)
    (start,) = [r["run"] for r in records if r["type"] == "run"]
    assert (start["display_name"], start["project"]) == ("run", "vitlab")
    assert start["config"]["update"]["lr"] == pytest.approx(1e-3) and start["config"]["update"]["logger"] == "wandb"
    history = wandb_history(records)
    assert sorted(history) == list(range(1, STEPS + 1))
    for tag, series in expected_scalars(run).items():
        for step, value in series.items():
            assert history[step][tag] == pytest.approx(value, rel=1e-9), (tag, step)
    assert all(history[STEPS][f"{tag}._type"] == "image-file" for tag in FIGURES)  # wandb's flattened record
    assert len(list(run_file.parent.glob("files/media/images/figures/*.png"))) == 3


def test_wandb_resume_continues_the_same_run_and_a_logger_change_is_allowed(wandb_offline, monkeypatch):
    run = crash_at_step(wandb_offline, monkeypatch, step=5, logger="wandb")
    run_id = (run / WANDB_ID_FILE).read_text().strip()
    resume(run, logger="tensorboard,wandb")  # no --allow-change: the logger does not change the numbers
    assert (run / WANDB_ID_FILE).read_text().strip() == run_id
    first, second = offline_run_files(run, run_id)  # `wandb sync` appends the second to the same run
    assert sorted(wandb_history(wandb_records(first))) == [1, 2, 3, 4]
    assert sorted(wandb_history(wandb_records(second))) == [4, 5, 6]
    assert (run / "tensorboard").is_dir()


def session_processes(sid: int) -> list[str]:
    """Command lines of the processes still in session `sid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:  # after the name: state, ppid, pgrp, session
                found.append((stat.parent / "cmdline").read_text().replace("\0", " "))
        except (OSError, IndexError, ValueError):
            continue
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_cli_with_wandb_offline_leaves_no_process_behind_and_never_asks(wandb_offline):
    args = ["--data", "digits", "--per-class", "6", "--model", "custom", "--model-args",
            "dim=16,depth=1,heads=2,mlp_dim=32,patch_size=4", "--batch-size", "20", "--steps", "2",
            "--warmup-steps", "1", "--threads", "1", "--quiet", "--logger", "wandb",
            "--out", str(wandb_offline), "--name", "cli"]
    proc = subprocess.Popen([sys.executable, "-m", "vitlab", "train", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert (wandb_offline / "cli" / WANDB_ID_FILE).is_file()
    assert session_processes(proc.pid) == []
