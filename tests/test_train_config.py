"""Recipes carry the paper's values; recipe < YAML < flags; unknown keys fail with one line."""

import pytest
import yaml

from vitlab.errors import VitlabError
from vitlab.train.config import RECIPES, TrainConfig, resolve_config


def test_pretrain_recipe_is_the_papers():
    cfg = resolve_config("pretrain")
    assert cfg.optimizer == "adamw" and cfg.betas == (0.9, 0.999)
    assert cfg.weight_decay == 0.1 and cfg.grad_clip == 1.0 and cfg.decay == "linear"


def test_finetune_recipe_is_the_papers():
    cfg = resolve_config("finetune")
    assert cfg.optimizer == "sgd" and cfg.momentum == 0.9 and cfg.weight_decay == 0.0
    assert cfg.decay == "cosine" and cfg.grad_clip == 1.0 and cfg.zero_head is True


def test_small_data_recipe():
    cfg = resolve_config("small-data")
    assert cfg.optimizer == "adamw" and cfg.label_smoothing == 0.1 and cfg.decay == "cosine"
    assert set(RECIPES) == {"pretrain", "finetune", "small-data"}


def test_precedence_recipe_yaml_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"lr": 0.02, "epochs": 3, "model_args": {"dim": 32}}))
    cfg = resolve_config("finetune", f, {"epochs": "5", "betas": "0.9,0.95", "randaugment": "2,9"})
    assert cfg.lr == 0.02 and cfg.epochs == 5.0 and cfg.optimizer == "sgd"
    assert cfg.betas == (0.9, 0.95) and cfg.randaugment == (2, 9) and cfg.model_args == {"dim": 32}


def test_saved_config_round_trips(tmp_path):
    cfg = resolve_config("pretrain", overrides={"lr": 3e-4, "crop_scale": [0.5, 1.0]})
    f = tmp_path / "config.yaml"
    f.write_text(yaml.safe_dump(cfg.to_dict()))
    again = resolve_config(None, f)
    assert again == cfg
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_unknown_key_and_bad_values_are_one_line_errors(tmp_path):
    with pytest.raises(VitlabError, match="unknown training setting 'lrr'"):
        resolve_config("small-data", overrides={"lrr": 1})
    with pytest.raises(VitlabError, match="unknown recipe"):
        resolve_config("nope")
    with pytest.raises(VitlabError, match="optimizer"):
        resolve_config("small-data", overrides={"optimizer": "lion"})


def test_model_args_merge_into_the_preset_and_reset_with_another_model(tmp_path):
    cfg = resolve_config("fashion-mnist", overrides={"model_args": "dim=96,mlp_dim=192"})
    assert cfg.model_args["dim"] == 96 and cfg.model_args["mlp_dim"] == 192
    assert cfg.model_args["patch_size"] == 1 and cfg.model_args["conv_stem"] == [48, 96, 192]
    # dotted keys build nested values, and a later source merges into them key by key
    yaml_file = tmp_path / "one_conv.yaml"
    yaml_file.write_text("model_args: {conv_stem: [], patch_size: 7, resnet: {layers: [], stem: small}}\n")
    dotted = resolve_config("fashion-mnist", yaml_file, overrides={"model_args": "resnet.stem=bit,patch_size=1"})
    assert dotted.model_args["resnet"] == {"layers": [], "stem": "bit"} and dotted.model_args["patch_size"] == 1
    assert dotted.model_args["conv_stem"] == [] and dotted.model_args["dim"] == 64
    wide = resolve_config("fashion-mnist", overrides={"model_args": "conv_stem=[64,128,256],dim=96"})
    assert wide.model_args["conv_stem"] == [64, 128, 256] and wide.model_args["dim"] == 96  # commas in [] kept
    with pytest.raises(VitlabError, match="cannot read the value of 'conv_stem'"):
        resolve_config("fashion-mnist", overrides={"model_args": "conv_stem=[64"})
    other = resolve_config("fashion-mnist", overrides={"model": "vit-ti/16", "model_args": "depth=2"})
    assert other.model == "vit-ti/16" and other.model_args == {"depth": 2}
