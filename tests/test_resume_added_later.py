"""Resuming a run recorded before a setting existed (config.ADDED_LATER, e.g. crop_sampler): the run goes on with
the value it trained with, and a different value asked for on the command line is a change of the run, refused
unless allowed, never silently replaced by the old value."""

import pytest
import yaml

from vitlab.commands.train import allowed_changes
from vitlab.errors import VitlabError
from vitlab.train.config import resolve_config
from vitlab.train.resume import check_run_settings


def _old_run(tmp_path, recipe: str = "finetune"):
    run = tmp_path / "run"
    run.mkdir()
    recorded = {k: v for k, v in resolve_config(recipe).to_dict().items() if k != "crop_sampler"}
    (run / "config.yaml").write_text(yaml.safe_dump(recorded, sort_keys=False))
    return run, recorded


def test_a_value_asked_for_on_resume_is_refused_not_replaced(tmp_path):
    run, recorded = _old_run(tmp_path)
    cfg = resolve_config("finetune", overrides={"resume": str(run), "crop_sampler": "tf"})
    assert cfg.crop_sampler == "tf"  # what was asked, not the old value put back
    with pytest.raises(VitlabError, match="crop_sampler"):
        check_run_settings(cfg, (), recorded)


def test_an_allowed_change_is_kept_and_reported(tmp_path):
    run, recorded = _old_run(tmp_path)
    cfg = resolve_config("finetune", overrides={"resume": str(run), "crop_sampler": "tf"})
    assert check_run_settings(cfg, ("crop_sampler",), recorded) == {"crop_sampler": ("torchvision", "tf")}
    assert cfg.crop_sampler == "tf"


def test_the_old_value_asked_for_is_no_change(tmp_path):
    run, recorded = _old_run(tmp_path, "pretrain")
    cfg = resolve_config("pretrain", overrides={"resume": str(run), "crop_sampler": "torchvision"})
    assert check_run_settings(cfg, (), recorded) == {}
    assert cfg.crop_sampler == "torchvision"


def test_a_run_without_any_record_keeps_the_recipe(tmp_path):
    cfg = resolve_config("finetune", overrides={"resume": str(tmp_path / "nothing")})
    assert cfg.crop_sampler == "tf"


def test_allow_change_accepts_the_setting_name():
    class Args:
        allow_change = ["crop_sampler"]  # argparse appends each --allow-change

    assert "crop_sampler" in allowed_changes(Args())
