"""config.yaml edited by hand between a stop and its resume: the resume is built from config.yaml, so the command
saw nothing to compare and the run went on with the edit, recorded nowhere (metrics.jsonl had no change record, and
the run claimed to continue exactly). An edit is now a change of the run like a flag: refused unless allowed, then
recorded. Tiny runs of the shared three-class set (tests/test_train_lifecycle.py)."""

import pytest
import torch
import yaml

from test_train_lifecycle import resume_cfg, run_interrupted, tiny_data
from vitlab.cli import main
from vitlab.errors import VitlabError
from vitlab.train import train
from vitlab.train.optim import lr_factor
from vitlab.train.run_dir import read_metrics

pytestmark = pytest.mark.usefixtures("keep_torch_threads")  # tests/conftest.py


def edit(run, **settings):
    path = run / "config.yaml"
    config = yaml.safe_load(path.read_text())
    for name, value in settings.items():
        if isinstance(value, dict):
            config[name] = {**config[name], **value}
        else:
            config[name] = value
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def changes(run):
    return [r["changed"] for r in read_metrics(run) if r["type"] == "change"]


def step_lrs(run):
    return {r["step"]: r["lr"] for r in read_metrics(run) if r["type"] == "step"}


def test_an_edited_setting_is_refused_in_one_line_naming_it_and_the_step(tmp_path, monkeypatch):
    run = run_interrupted(tmp_path, monkeypatch, step=4)  # checkpoint at step 4, lr 1e-3
    edit(run, lr=0.05, label_smoothing=0.2)
    with pytest.raises(VitlabError, match=r"config.yaml was edited after checkpoint step 4 was written \(lr 0.001 -> "
                                          r"0.05, label_smoothing 0.0 -> 0.2\).*--allow-change lr,label_smoothing"):
        train(resume_cfg(run), data=tiny_data())
    assert changes(run) == []


def test_an_edited_model_is_named_as_an_edit_not_a_shape_mismatch(tmp_path, monkeypatch):
    run = run_interrupted(tmp_path, monkeypatch, step=4)
    edit(run, model_args=dict(dim=48))
    with pytest.raises(VitlabError, match=r"edited after checkpoint step 4 .*model_args.dim 32 -> 48"):
        train(resume_cfg(run), data=tiny_data())


def test_an_allowed_edit_is_applied_and_recorded(tmp_path, monkeypatch):
    run = run_interrupted(tmp_path, monkeypatch, step=4)
    edit(run, lr=0.05)
    train(resume_cfg(run), data=tiny_data(), allow_change=("lr",))
    assert changes(run) == [{"lr": [0.001, 0.05]}]
    lrs = step_lrs(run)
    for step in (5, 6):  # the lr of step s is set after step s - 1
        assert lrs[step] == pytest.approx(0.05 * lr_factor(step - 1, 6, 1)), step


def test_an_edit_and_a_flag_on_the_same_setting_record_the_whole_change(tmp_path, monkeypatch):
    run = run_interrupted(tmp_path, monkeypatch, step=4)
    edit(run, lr=0.05)
    train(resume_cfg(run, lr=0.02), data=tiny_data(), allow_change=("lr",))
    assert changes(run) == [{"lr": [0.001, 0.02]}]
    assert yaml.safe_load((run / "config.yaml").read_text())["lr"] == 0.02


def test_an_edit_put_back_by_the_command_continues_exactly_and_restores_config_yaml(tmp_path, monkeypatch):
    ref = train(resume_cfg(run_interrupted(tmp_path, monkeypatch, step=4, name="ref")), data=tiny_data())
    run = run_interrupted(tmp_path, monkeypatch, step=4)
    edit(run, lr=0.05)
    result = train(resume_cfg(run, lr=0.001), data=tiny_data(), allow_change=("lr",))
    assert changes(run) == []
    assert yaml.safe_load((run / "config.yaml").read_text())["lr"] == 0.001
    assert result.best_val_acc == ref.best_val_acc and step_lrs(run) == step_lrs(ref.run_dir)


def test_a_change_allowed_at_an_earlier_resume_of_the_checkpoint_is_no_edit(tmp_path, monkeypatch):
    """A resume with --allow-change writes config.yaml before the next checkpoint; resumed again from the same
    checkpoint (a kill before the next one), config.yaml differs from it by that recorded change alone."""
    run = run_interrupted(tmp_path, monkeypatch, step=4)
    train(resume_cfg(run, lr=0.05), data=tiny_data(), allow_change=("lr",))
    resumed = resume_cfg(run)
    resumed.resume = str(run / "checkpoints" / "step-0000004.pt")
    train(resumed, data=tiny_data())  # not refused
    assert changes(run) == [{"lr": [0.001, 0.05]}]


def test_neutral_settings_may_be_edited(tmp_path, monkeypatch):
    run = run_interrupted(tmp_path, monkeypatch, step=4)
    edit(run, log_every=3, keep_last=5)
    train(resume_cfg(run), data=tiny_data())
    assert changes(run) == []


def test_the_cli_refuses_an_edit_in_one_line(tmp_path, monkeypatch, capsys):
    run = run_interrupted(tmp_path, monkeypatch, step=4, data="digits", per_class=6)
    edit(run, weight_decay=0.5)
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "weight_decay 0.05 -> 0.5" in err[0] and "--allow-change weight_decay" in err[0], err
    assert torch.load(sorted((run / "checkpoints").glob("step-*.pt"))[-1], weights_only=True)["global_step"] == 4
