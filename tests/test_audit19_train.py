"""Audit 19, training: "resume anything exactly", and a resume with an allowed change does what config.yaml then
records. Tiny runs of the shared 8x8 three-class set (tests/test_train_loop.py), interrupted by a real SIGINT."""

import pytest
import torch
import yaml

from test_train_lifecycle import resume_cfg, run_interrupted, tiny_data
from vitlab.train import train
from vitlab.train.optim import lr_factor
from vitlab.train.run_dir import read_metrics

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
