"""Audit of the run lifecycle: kills between the files of one checkpoint, checkpoints of an abandoned future,
what `--resume` accepts (a file outside checkpoints/, a file that is no training checkpoint, the checkpoints/
folder itself, a run folder without config.yaml) and config.yaml written whole."""

import errno
import pathlib

import pytest
import torch

from test_train_lifecycle import ARGS, resume_cfg, run_interrupted, tiny_cfg, tiny_data
from vitlab.cli import main
from vitlab.errors import VitlabError
from vitlab.train import checkpoint as ck
from vitlab.train import loop, resolve_config, train
from vitlab.train.checkpoint import CheckpointManager

pytestmark = pytest.mark.usefixtures("keep_torch_threads")  # tests/conftest.py


class Killed(BaseException):
    """A SIGKILL, as far as the files are concerned: nothing after this point runs (not caught as an Exception)."""


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("vitlab: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------ best.pt and the epoch's step checkpoint
@pytest.mark.parametrize("writes", [2, 3])
def test_a_kill_between_the_epoch_end_files_keeps_best_pt(tmp_path, monkeypatch, writes):
    """The epoch end writes a step checkpoint and best.pt. A kill after the step checkpoint but before best.pt
    lost best.pt for good: the resume starts after that epoch, with its accuracy already counted as the best, so
    no later epoch rewrote it (summary.json named a best accuracy whose checkpoint did not exist)."""
    ref = train(tiny_cfg(tmp_path, name="ref"), data=tiny_data())  # writes: step 2, then the epoch end at step 3
    real, calls = ck.atomic_save, {"n": 0}

    def killed_after(*args, **kwargs):
        out = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == writes:  # 2: after the epoch end's first file, 3: after both
            raise Killed
        return out

    with monkeypatch.context() as m:
        m.setattr(ck, "atomic_save", killed_after)
        with pytest.raises(Killed):
            train(tiny_cfg(tmp_path), data=tiny_data())
    run = tmp_path / "run"
    (run / "run.lock").unlink(missing_ok=True)  # a SIGKILL leaves it; a stale lock is taken over anyway
    train(resume_cfg(run), data=tiny_data())
    a = torch.load(ref.run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert (run / "checkpoints" / "best.pt").is_file(), "best.pt was lost"
    b = torch.load(run / "checkpoints" / "best.pt", weights_only=True)
    assert (a["global_step"], a["best_metric"]) == (b["global_step"], b["best_metric"])
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


# ------------------------------------------------------------------ checkpoints of an abandoned future
def test_resuming_from_an_older_checkpoint_drops_the_later_ones(tmp_path, monkeypatch, capsys):
    """Resuming from an older checkpoint file drops the later records of metrics.jsonl, but left the later
    checkpoints: killed again before it wrote a checkpoint of a higher step, `--resume RUN` went on from the
    abandoned run's weights under the new run's metrics and settings."""
    run = run_interrupted(tmp_path, monkeypatch, step=5)  # checkpoints at steps 4 and 5
    capsys.readouterr()
    older = run / "checkpoints" / "step-0000004.pt"

    def kill(*args, **kwargs):
        raise Killed

    with monkeypatch.context() as m:
        m.setattr(loop, "params_finite", kill)  # killed in the first step after the resume, before a checkpoint
        with pytest.raises(Killed):
            cfg = resolve_config(None, run / "config.yaml", dict(lr=5e-4, resume=str(older)))
            train(cfg, data=tiny_data(), allow_change=("lr",))
    assert "step-0000005.pt" in capsys.readouterr().err  # the note names what it set aside
    assert CheckpointManager(run / "checkpoints").latest().name == "step-0000004.pt"
    (run / "run.lock").unlink(missing_ok=True)
    train(resume_cfg(run), data=tiny_data())
    assert "resuming from step 4" in capsys.readouterr().out


# ------------------------------------------------------------------ what --resume accepts
def cli_run(tmp_path, capsys):
    steps = [*ARGS[: ARGS.index("--epochs")], "--steps", "4", *ARGS[ARGS.index("--epochs") + 2:]]
    assert main(["train", *steps, "--ckpt-every", "2", "--out", str(tmp_path), "--name", "run"]) == 0
    capsys.readouterr()
    return tmp_path / "run"


def test_resume_of_files_that_are_no_checkpoint_of_a_run_is_one_line(tmp_path, capsys):
    run = cli_run(tmp_path, capsys)
    lone = tmp_path / "step.pt"  # a checkpoint copied out of its run: the run folder would be the file itself
    lone.write_bytes((run / "checkpoints" / "step-0000004.pt").read_bytes())
    for given in (lone, run / "config.yaml"):
        assert main(["train", "--resume", str(given)]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "File exists" not in line and "checkpoints/" in line, line
    weights = run / "checkpoints" / "weights.pt"  # a plain state dict: no optimizer, no position
    torch.save(torch.load(lone, weights_only=True)["model"], weights)
    assert main(["train", "--resume", str(weights)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "not a training checkpoint" in line and "KeyError" not in line, line


def test_a_latest_file_that_is_no_training_checkpoint_is_skipped_like_a_damaged_one(tmp_path, capsys):
    run = cli_run(tmp_path, capsys)
    state = torch.load(run / "checkpoints" / "step-0000004.pt", weights_only=True)
    torch.save({k: v for k, v in state.items() if k != "optimizer"}, run / "checkpoints" / "step-0000009.pt")
    assert main(["train", "--resume", str(run)]) == 0
    captured = capsys.readouterr()
    assert "step-0000009.pt is not a training checkpoint" in captured.err
    assert "resuming from step 4" in captured.out


def test_resume_of_the_checkpoints_folder_resumes_its_run(tmp_path, capsys):
    run = cli_run(tmp_path, capsys)
    assert main(["train", "--resume", str(run / "checkpoints")]) == 0, capsys.readouterr().err
    assert f"run folder {run} (resuming from step 4)" in capsys.readouterr().out


def test_a_run_folder_without_config_yaml_resumes_with_the_checkpoints_settings(tmp_path, capsys):
    """config.yaml gone (deleted, lost): the resume took the default recipe and said the checkpoint did not fit
    the model; with --data and --model-args given it would have trained on with other settings. The
    checkpoint records the settings too."""
    run = cli_run(tmp_path, capsys)
    recorded = (run / "config.yaml").read_text()
    (run / "config.yaml").unlink()
    assert main(["train", "--resume", str(run)]) == 0, capsys.readouterr().err
    assert "no config.yaml" in capsys.readouterr().err
    assert (run / "config.yaml").read_text() == recorded  # written again


def test_finetune_resume_of_a_run_from_scratch_names_the_command(tmp_path, capsys):
    run = cli_run(tmp_path, capsys)
    assert main(["finetune", "--resume", str(run)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"vitlab train --resume {run}" in line, line


# ------------------------------------------------------------------ config.yaml written whole
def test_config_yaml_survives_a_full_disk_while_it_is_rewritten(tmp_path, monkeypatch):
    """An allowed change on resume rewrites config.yaml; a full disk (or a kill) in the middle of that write left
    half a file, and every later `--resume RUN` then stopped on invalid YAML."""
    run = run_interrupted(tmp_path, monkeypatch, step=4)
    before = (run / "config.yaml").read_text()
    real = pathlib.Path.write_text

    def full_disk(self, text, *args, **kwargs):
        if self.name.endswith("config.yaml") or ".config.yaml.tmp-" in self.name:
            real(self, text[:20], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, text, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "write_text", full_disk)
        with pytest.raises((OSError, VitlabError)):
            train(resume_cfg(run, lr=5e-4), data=tiny_data(), allow_change=("lr",))
    assert (run / "config.yaml").read_text() == before
    assert not list(run.glob(".config.yaml.tmp-*"))


# ------------------------------------------------------------------ Ctrl-C in the final evaluation
def test_ctrl_c_in_the_final_evaluation_says_how_to_finish_the_run(tmp_path, monkeypatch, capsys):
    """After the last step Ctrl-C stops at once (the final test pass); the run then ended with the CLI's bare
    `interrupted`, though every step was checkpointed and `--resume` writes the missing evaluation and files."""
    real, calls = loop.predict_split, {"n": 0}

    def ctrl_c_in_the_test_pass(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # the validations of epochs 1 and 2, then the test split
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(loop, "predict_split", ctrl_c_in_the_test_pass)
        with pytest.raises(KeyboardInterrupt):
            train(tiny_cfg(tmp_path, ckpt_every=0), data=tiny_data())
    run = tmp_path / "run"
    err = capsys.readouterr().err
    assert "interrupted in the final evaluation after all 6 steps" in err, err
    assert f"resume with: vitlab train --resume {run}" in err
    train(resume_cfg(run), data=tiny_data())
    assert (run / "summary.json").is_file()
