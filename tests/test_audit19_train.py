"""Audit 19, training: "resume anything exactly", and a resume with an allowed change does what config.yaml then
records. Tiny runs of the shared 8x8 three-class set (tests/test_train_loop.py), interrupted by a real SIGINT."""

import json
import os
import shutil
import socket

import pytest
import torch
import yaml

from test_train_lifecycle import ARGS, dead_pid, resume_cfg, run_interrupted, tiny_cfg, tiny_data
from vitlab.cli import main
from vitlab.errors import VitlabError
from vitlab.train import loop, resolve_config, run_dir, train
from vitlab.train.optim import lr_factor
from vitlab.train.run_dir import LOCK_NAME, RunLock, read_metrics

pytestmark = pytest.mark.usefixtures("keep_torch_threads")  # tests/conftest.py


def last_checkpoint(run):
    return torch.load(sorted((run / "checkpoints").glob("step-*.pt"))[-1], weights_only=True)


# ------------------------------------------------- an allowed change of the optimizer's settings is applied
def test_allowed_lr_weight_decay_and_betas_are_what_the_resumed_steps_use(tmp_path, monkeypatch):
    """torch's load_state_dict put back the checkpoint's lr, weight decay and betas: config.yaml recorded the new
    values, and every later step trained with the old ones."""
    run = run_interrupted(tmp_path, monkeypatch, step=4)  # 6 steps, cosine after 1 warm-up step, lr 1e-3
    train(resume_cfg(run, lr=0.05, weight_decay=0.3, betas=(0.5, 0.6)), data=tiny_data(),
          allow_change=("lr", "weight_decay", "betas"))
    assert yaml.safe_load((run / "config.yaml").read_text())["lr"] == 0.05
    lrs = {r["step"]: r["lr"] for r in read_metrics(run) if r["type"] == "step"}
    assert lrs[4] == pytest.approx(1e-3 * lr_factor(3, 6, 1))  # before the resume: the run's own lr
    for step in (5, 6):  # the lr of step s is set after step s - 1
        assert lrs[step] == pytest.approx(0.05 * lr_factor(step - 1, 6, 1)), step
    groups = last_checkpoint(run)["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.3, 0.0]  # the decayed weight matrices, then the rest
    assert all(tuple(g["betas"]) == (0.5, 0.6) and g["initial_lr"] == 0.05 for g in groups)


def test_allowed_change_of_optimizer_starts_its_state_afresh(tmp_path, monkeypatch, capsys):
    """AdamW's state resumed under SGD failed on a bare KeyError ('momentum'); under Adam it kept AdamW's weight
    decay, which --optimizer adam does not apply."""
    run = run_interrupted(tmp_path, monkeypatch, step=4)
    train(resume_cfg(run, optimizer="sgd", momentum=0.8), data=tiny_data(), allow_change=("optimizer", "momentum"))
    state = last_checkpoint(run)["optimizer"]
    assert all(g["momentum"] == 0.8 and "betas" not in g for g in state["param_groups"])
    assert all(set(s) == {"momentum_buffer"} for s in state["state"].values())
    assert "optimizer adamw -> sgd: its state (moments, momentum) starts afresh at step 4" in capsys.readouterr().err


# ------------------------------------------------- best.pt of an abandoned continuation
def test_resume_from_an_older_checkpoint_sets_a_later_best_pt_aside(tmp_path, capsys):
    """best.pt written after the checkpoint a resume starts from stayed the run's best.pt whenever the new
    continuation scored lower: `vitlab evaluate RUN/checkpoints/best.pt` then scored weights that the run's
    metrics.jsonl and summary.json (best_val_acc) no longer hold."""
    ref = train(tiny_cfg(tmp_path, keep_last=10, lr=3e-3), data=tiny_data())
    run, folder = ref.run_dir, ref.run_dir / "checkpoints"
    first = torch.load(folder / "step-0000003.pt", weights_only=True)  # the end of epoch 1 (3 steps an epoch)
    assert torch.load(folder / "best.pt", weights_only=True)["global_step"] == 6  # epoch 2 scored better
    capsys.readouterr()
    # epoch 2 again, now learning nothing
    again = resolve_config(None, run / "config.yaml", dict(lr=1e-12, resume=str(folder / "step-0000003.pt")))
    result = train(again, data=tiny_data(), allow_change=("lr",))
    best = torch.load(folder / "best.pt", weights_only=True)  # the resumed checkpoint is the run's best epoch
    assert best["global_step"] == 3 and best["best_metric"] == result.best_val_acc == first["best_val"]
    assert all(torch.equal(best["model"][k], first["model"][k]) for k in first["model"])
    assert (folder / "abandoned" / "best.pt").is_file()
    assert "best.pt to" in capsys.readouterr().err  # the note names what it set aside


# ------------------------------------------------- a fine-tuning's weights, resumed from another folder
def test_finetuning_resumed_from_another_folder_reads_the_weights_it_started_from(tmp_path, monkeypatch):
    """--weights was recorded as typed: resumed from another folder, a relative path read another file of that
    name there, and the run went on with that file's normalisation (model/config.json mean 0.2, config.yaml 0.5)."""
    pre = train(tiny_cfg(tmp_path, name="pre", epochs=1), data=tiny_data()).run_dir / "model"
    here, there = tmp_path / "here", tmp_path / "there"
    for folder, mean in ((here, 0.5), (there, 0.2)):  # two model folders named w/ that differ in their input
        shutil.copytree(pre, folder / "w")
        config = json.loads((folder / "w" / "config.json").read_text())
        config["preprocess"]["mean"] = [mean]
        (folder / "w" / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(here)
    run = run_interrupted(tmp_path, monkeypatch, step=4, name="ft", weights="w")
    assert yaml.safe_load((run / "config.yaml").read_text())["weights"] == str(here / "w")
    monkeypatch.chdir(there)
    train(resume_cfg(run), data=tiny_data())
    assert json.loads((run / "model" / "config.json").read_text())["preprocess"]["mean"] == [0.5]


# ------------------------------------------------- a run folder copied while its run still trains
def test_a_lock_copied_with_its_run_folder_does_not_block_the_copy(tmp_path, capsys):
    """`cp -r runs/a runs/b` while runs/a trains copies runs/a/run.lock: `--resume runs/b` was refused as in use by
    runs/a's process, with the advice to kill that run. The lock names its folder; the original stays locked."""
    original = train(tiny_cfg(tmp_path, name="a"), data=tiny_data()).run_dir
    alive = os.getppid()  # a live process on this machine stands for the run still training in runs/a
    where = os.stat(original)  # the folder the lock was written in: (device, inode)
    holder = {"pid": alive, "host": socket.gethostname(), "started": "now", "folder": [where.st_dev, where.st_ino]}
    (original / "run.lock").write_text(json.dumps(holder))
    copy = tmp_path / "b"
    shutil.copytree(original, copy)
    train(resume_cfg(copy), data=tiny_data())
    assert "copied with the folder from a run of process" in capsys.readouterr().err
    with pytest.raises(VitlabError, match=f"in use by process {alive}"):
        train(resume_cfg(original), data=tiny_data())


# ------------------------------------------------- two processes taking over one stale lock
def test_two_processes_taking_over_one_stale_lock_do_not_both_hold_it(tmp_path, monkeypatch):
    """Two resumes after a SIGKILL both read the stale lock; the first removed it and wrote its own, then the second
    removed that one too (it had judged the file by what it read before) and wrote its own: two processes trained
    one run folder. Now the second moves the lock aside, sees it is another and puts it back."""
    folder = tmp_path / "run"
    folder.mkdir()
    lock = folder / LOCK_NAME
    lock.write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname(), "started": "then"}))
    first = {"pid": os.getppid(), "host": socket.gethostname(), "started": "now"}  # live, on this machine
    real_read = run_dir.read_lock

    def first_takes_over_after_our_look(path):
        holder = real_read(path)  # what we judge: the stale lock
        monkeypatch.setattr(run_dir, "read_lock", real_read)
        path.unlink()  # meanwhile the first process takes it over
        path.write_text(json.dumps(first))
        return holder

    monkeypatch.setattr(run_dir, "read_lock", first_takes_over_after_our_look)
    with pytest.raises(VitlabError, match=f"in use by process {first['pid']}"):
        RunLock().acquire(folder)
    assert json.loads(lock.read_text()) == first
    assert [p.name for p in folder.iterdir()] == [LOCK_NAME]  # nothing aside or temporary left behind


# ------------------------------------------------- a run stopped before its first checkpoint
class Killed(BaseException):
    """A SIGKILL, as far as the run folder is concerned: nothing after this point runs."""


def test_a_run_stopped_before_its_first_checkpoint_resumes_from_the_start(tmp_path, monkeypatch, capsys):
    """With --ckpt-every 200 a kill in the first 200 steps leaves config.yaml and metrics.jsonl but no checkpoint:
    `--resume RUN` was refused (no checkpoints) and the same command again too (the folder holds a run)."""
    # one thread for both runs: the automatic count follows the load, and another count sums in another order
    ref = train(tiny_cfg(tmp_path, name="ref", ckpt_every=0, threads=1), data=tiny_data()).model
    real, calls = loop.params_finite, {"n": 0}

    def killed_in_step_2(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise Killed
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(loop, "params_finite", killed_in_step_2)
        with pytest.raises(Killed):
            train(tiny_cfg(tmp_path, ckpt_every=0, threads=1), data=tiny_data())
    run = tmp_path / "run"
    assert not list((run / "checkpoints").iterdir()) and read_metrics(run)  # step 1's record, no checkpoint
    capsys.readouterr()
    again = train(resume_cfg(run), data=tiny_data())
    assert "it starts again from step 0" in capsys.readouterr().err
    for (k, a), b in zip(ref.state_dict().items(), again.model.state_dict().values()):
        assert torch.equal(a, b), k
    steps = [r["step"] for r in read_metrics(run) if r["type"] == "step"]
    assert steps == sorted(set(steps)) == list(range(1, 7))  # each step once: the stopped attempt's records went


def test_a_finetuning_resumes_with_the_normalisation_it_started_with(tmp_path, monkeypatch):
    """A resume read the mean and std from the weights again: where the file had changed since the run started
    (re-saved, another vitlab's record of a pretrained name), the run went on with another normalisation than
    config.yaml records, and ended with other weights than the run left alone."""
    weights = train(tiny_cfg(tmp_path, name="pre", epochs=1), data=tiny_data()).run_dir / "model"
    # one thread for both: the automatic count follows the machine's load, and another sums in another order
    ref = train(tiny_cfg(tmp_path, name="ref", weights=str(weights), threads=1), data=tiny_data()).model
    run = run_interrupted(tmp_path, monkeypatch, step=4, name="ft", weights=str(weights), threads=1)
    config = json.loads((weights / "config.json").read_text())
    config["preprocess"]["mean"] = [0.2]  # the weights' file changes before the resume
    (weights / "config.json").write_text(json.dumps(config))
    again = train(resume_cfg(run), data=tiny_data()).model
    for (k, a), b in zip(ref.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k
    assert json.loads((run / "model" / "config.json").read_text())["preprocess"]["mean"] == [0.5]


def test_a_resume_at_another_image_size_names_the_tensor_that_does_not_fit(tmp_path, monkeypatch):
    """--image-size with --allow-change image_size builds position embeddings of another grid; the one line said
    'another model or model_args than the run's' and named neither the tensor nor the image size."""
    run = run_interrupted(tmp_path, monkeypatch, step=4)  # 8 px, patches of 2: 16 positions and the class token
    with pytest.raises(VitlabError) as err:
        train(resume_cfg(run, image_size=12), data=tiny_data(), allow_change=("image_size",))
    assert "pos_embed: checkpoint [1, 17, 32], model [1, 37, 32]; another model, model_args or image_size" in str(
        err.value)


def test_recipe_on_resume_is_refused_in_one_line_not_dropped(tmp_path, capsys):
    """`vitlab train --resume RUN --recipe pretrain` went on with the run's recorded small-data settings without a
    word (config.yaml outranks a recipe); the run's own recipe named again still resumes."""
    steps = [*ARGS[: ARGS.index("--epochs")], "--steps", "2", *ARGS[ARGS.index("--epochs") + 2:]]
    assert main(["train", *steps, "--threads", "1", "--out", str(tmp_path), "--name", "run"]) == 0
    run = str(tmp_path / "run")
    capsys.readouterr()
    assert main(["train", "--resume", run, "--recipe", "pretrain"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "with --recipe pretrain: the run continues with its recorded settings" in err
    assert main(["train", "--resume", run, "--recipe", "small-data"]) == 0
