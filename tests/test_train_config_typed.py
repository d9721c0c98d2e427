"""Every TrainConfig value is coerced to its field's declared type, wherever it comes from (YAML, --set,
flags, --model-args, the Python API), and impossible values are refused before anything is created."""

import pytest
import yaml

from vitlab.cli import main
from vitlab.errors import VitlabError
from vitlab.train import train
from vitlab.train.config import TrainConfig, resolve_config, typed_model_args


def _from_yaml(tmp_path, text: str) -> TrainConfig:
    f = tmp_path / "c.yaml"
    f.write_text(text)
    return resolve_config("small-data", f)


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    """PyYAML (YAML 1.1) reads `3e-4` as a string: it used to fail with a TypeError."""
    assert yaml.safe_load("lr: 3e-4")["lr"] == "3e-4"  # the cause
    cfg = _from_yaml(tmp_path, "lr: 3e-4\nweight_decay: 1e-2\nlr_end: 1E-5\n")
    assert cfg.lr == 3e-4 and isinstance(cfg.lr, float)
    assert cfg.weight_decay == 0.01 and cfg.lr_end == 1e-5


def test_set_values_take_the_field_types():
    cfg = resolve_config("small-data", overrides={"lr": "1e-3", "steps": "1e3", "batch_size": "64", "epochs": "2",
                                                  "hflip": "yes", "deterministic": "false", "grad_clip": "null",
                                                  "warmup_steps": "none", "micro_batch": "32", "name": "2024"})
    assert cfg.lr == 1e-3 and cfg.steps == 1000 and cfg.batch_size == 64 and cfg.epochs == 2.0
    assert cfg.hflip is True and cfg.deterministic is False and cfg.grad_clip is None
    assert cfg.warmup_steps is None and cfg.micro_batch == 32 and cfg.name == "2024"
    assert isinstance(cfg.steps, int) and isinstance(cfg.epochs, float)


def test_yaml_1_1_booleans_and_nulls(tmp_path):
    cfg = _from_yaml(tmp_path, "hflip: no\ninception_crop: off\nwarmup_steps: ~\nhead_bias_init: null\n")
    assert cfg.hflip is False and cfg.inception_crop is False
    assert cfg.warmup_steps is None and cfg.head_bias_init is None


@pytest.mark.parametrize("value,expected", [
    ("0.9,0.95", (0.9, 0.95)), ("(0.9, 0.95)", (0.9, 0.95)), ("[0.9,0.95]", (0.9, 0.95)), ([0.9, 0.95], (0.9, 0.95)),
])
def test_tuples_from_text_or_lists(value, expected):
    cfg = resolve_config("small-data", overrides={"betas": value, "crop_scale": "0.5,1", "randaugment": "2,9"})
    assert cfg.betas == expected and cfg.crop_scale == (0.5, 1.0) and cfg.randaugment == (2, 9)
    assert resolve_config("small-data", overrides={"randaugment": "none"}).randaugment is None


def test_per_channel_statistics():
    cfg = resolve_config("small-data", overrides={"mean": "0.485,0.456,0.406", "std": [0.229, 0.224, 0.225]})
    assert cfg.mean == [0.485, 0.456, 0.406] and cfg.std == [0.229, 0.224, 0.225]
    assert resolve_config("small-data", overrides={"mean": "0.5"}).mean == 0.5


def test_model_args_take_the_model_config_types():
    cfg = resolve_config("small-data", overrides={"model": "custom",
                                                  "model_args": "dim=64,layer_norm_eps=1e-5,resnet.ws_eps=1e-8"})
    assert cfg.model_args["layer_norm_eps"] == 1e-5 and isinstance(cfg.model_args["layer_norm_eps"], float)
    assert cfg.model_args["resnet"]["ws_eps"] == 1e-8
    assert typed_model_args({"conv_stem": [48, 96], "classifier": "gap"}) == {"conv_stem": [48, 96], "classifier": "gap"}
    with pytest.raises(VitlabError, match=r"model argument dim must be a whole number .*got 'abc'"):
        resolve_config("small-data", overrides={"model_args": "dim=abc"})
    with pytest.raises(VitlabError, match="model argument qkv_bias must be true or false"):
        resolve_config("small-data", overrides={"model_args": {"qkv_bias": "maybe"}})


@pytest.mark.parametrize("key,value,expected", [
    ("lr", "abc", "lr must be a finite number"),
    ("lr", "nan", "lr must be a finite number"),
    ("lr", "inf", "lr must be a finite number"),
    ("lr", None, "lr must be a finite number"),
    ("batch_size", "64.5", "batch_size must be a whole number"),
    ("batch_size", True, "batch_size must be a whole number"),
    ("steps", "ten", "steps must be a whole number"),
    ("hflip", "3", "hflip must be true or false"),
    ("deterministic", 1.5, "deterministic must be true or false"),
    ("betas", "0.9", "betas must be 2 numbers"),
    ("randaugment", "2,9,1", "randaugment must be 2 whole numbers"),
    ("data", ["a", "b"], "data must be a text value"),
    ("mean", "x", "mean must be a finite number or one per channel"),
])
def test_a_value_of_the_wrong_type_is_one_line_naming_field_value_and_type(key, value, expected):
    with pytest.raises(VitlabError, match=expected) as exc:
        resolve_config("small-data", overrides={key: value})
    message = str(exc.value)
    assert "\n" not in message and (repr(value) in message or "null" in message)


@pytest.mark.parametrize("key,value,expected", [
    ("steps", -3, "steps must be >= 0"),
    ("epochs", -1, "epochs must be >= 0"),
    ("batch_size", 0, "batch_size must be >= 1"),
    ("micro_batch", 0, "micro_batch must be >= 1"),
    ("eval_batch_size", -2, "eval_batch_size must be >= 1"),
    ("lr", 0, "lr must be > 0"),
    ("lr", -1e-3, "lr must be > 0"),
    ("warmup_steps", -1, "warmup_steps must be >= 0"),
    ("warmup_epochs", -0.5, "warmup_epochs must be >= 0"),
    ("weight_decay", -0.1, "weight_decay must be >= 0"),
    ("threads", 0, "threads must be >= 1"),
    ("label_smoothing", 1.0, r"label_smoothing must be in \[0, 1\)"),
    ("dropout", -0.1, r"dropout must be in \[0, 1\)"),
    ("drop_path", 1.0, r"drop_path must be in \[0, 1\)"),
    ("random_erasing", 1.5, r"random_erasing must be in \[0, 1\]"),
    ("mixup", -0.2, "mixup must be >= 0"),
    ("cutmix", -1, "cutmix must be >= 0"),
    ("momentum", 1.0, r"momentum must be in \[0, 1\)"),
    ("betas", "0.9,1.0", "betas must be two numbers in"),
    ("crop_scale", "0,1", "crop_scale must be"),
    ("randaugment", "2,31", "randaugment must be"),
    ("val_fraction", 1, r"val_fraction must be in \[0, 1\)"),
    ("per_class", 0, "per_class must be >= 1"),
    ("image_size", 0, "image_size must be >= 1"),
    ("std", "0.5,0,0.5", "std must be > 0"),
    ("seed", -1, "seed must be >= 0"),
    ("log_every", 0, "log_every must be >= 1"),
])
def test_out_of_range_values_are_refused(key, value, expected):
    with pytest.raises(VitlabError, match=expected):
        resolve_config("small-data", overrides={key: value})


def test_steps_zero_means_epochs():
    assert resolve_config("small-data", overrides={"steps": 0, "epochs": 2}).steps == 0
    with pytest.raises(VitlabError, match="set epochs > 0 or steps > 0"):
        resolve_config("small-data", overrides={"steps": 0, "epochs": 0})
    assert resolve_config("finetune").epochs == 0  # the fine-tuning recipe counts steps


def test_unknown_key_suggests_the_near_miss(tmp_path):
    with pytest.raises(VitlabError, match=r"unknown training setting 'batch_sise' \(from .*c.yaml\); did you mean batch_size"):
        _from_yaml(tmp_path, "batch_sise: 64\n")


def test_validate_coerces_a_config_built_in_python():
    cfg = TrainConfig(lr="3e-4", steps="10", betas=[0.9, 0.95])
    from vitlab.train.config import validate

    validate(cfg)
    assert cfg.lr == 3e-4 and cfg.steps == 10 and cfg.betas == (0.9, 0.95)
    with pytest.raises(VitlabError, match="lr must be a finite number"):
        validate(TrainConfig(lr=float("nan")))


def test_train_refuses_before_creating_the_run_folder(tmp_path):
    out = tmp_path / "runs"
    with pytest.raises(VitlabError, match="batch_size must be >= 1"):
        train(TrainConfig(out_dir=str(out), batch_size=0))
    with pytest.raises(VitlabError, match="steps must be >= 0"):
        train(TrainConfig(out_dir=str(out), steps=-3))
    assert not out.exists()


def test_typed_config_round_trips_through_config_yaml(tmp_path):
    cfg = _from_yaml(tmp_path, "lr: 3e-4\nbetas: [0.9, 0.95]\nmean: [0.5, 0.5, 0.5]\nrandaugment: 2,9\n")
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(cfg.to_dict()))
    assert resolve_config(None, saved) == cfg


def test_cli_train_with_an_exponent_lr_runs(tmp_path, capsys):
    """`lr: 3e-4` in a config and `--set lr=1e-3` end to end: the run starts and finishes."""
    config = tmp_path / "c.yaml"
    config.write_text("lr: 3e-4\nwarmup_steps: 0\n")
    out = tmp_path / "runs"
    code = main(["train", "--config", str(config), "--set", "lr=1e-3", "--data", "bundled", "--per-class", "4",
                 "--model-args", "dim=16,depth=1,heads=2,mlp_dim=32,patch_size=7,conv_stem=[]", "--steps", "1",
                 "--batch-size", "8", "--eval-batch-size", "64", "--threads", "1", "--out", str(out),
                 "--name", "run", "--quiet", "--set", "save_model=false"])
    assert code == 0, capsys.readouterr().err
    saved = yaml.safe_load((out / "run" / "config.yaml").read_text())
    assert saved["lr"] == 1e-3 and saved["steps"] == 1


def test_a_length_in_epochs_overrides_an_earlier_layers_steps(tmp_path):
    """Steps win within one layer; a later layer's epochs win over an earlier one's steps. Before, the finetune
    recipe's 1000 steps silently outlived `vitlab finetune --epochs 1` (500 epochs on a 20-image set)."""
    from vitlab.train.config import resolve_config

    recipe = resolve_config("finetune")
    assert (recipe.steps, recipe.warmup_steps) == (1000, 100)
    cfg = resolve_config("finetune", overrides={"epochs": 1, "warmup_epochs": 0.5})
    assert (cfg.epochs, cfg.steps, cfg.warmup_epochs, cfg.warmup_steps) == (1, 0, 0.5, None)
    both = resolve_config("finetune", overrides={"epochs": 1, "steps": 50, "warmup": 5})
    assert (both.steps, both.warmup_steps) == (50, 5)
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("epochs: 3\n")
    from_file = resolve_config("finetune", yaml_file)
    assert (from_file.epochs, from_file.steps) == (3, 0)
    assert resolve_config("finetune", yaml_file, {"steps": 7}).steps == 7  # the command line's steps win again


def test_set_overrides_the_flags_across_a_lengths_units():
    """docs/training.md: flags < --set. Merged into one layer, `--steps 3 --set epochs=2` trained 3 steps."""
    from vitlab.cli import build_parser
    from vitlab.commands.train import config_from_args

    def cfg_of(*argv):
        return config_from_args(build_parser().parse_args(["train", "--data", "bundled", *argv]), "small-data")

    cfg = cfg_of("--steps", "3", "--set", "epochs=2")
    assert (cfg.steps, cfg.epochs) == (0, 2)
    cfg = cfg_of("--warmup-steps", "3", "--set", "warmup_epochs=1")
    assert (cfg.warmup_steps, cfg.warmup_epochs) == (None, 1)
    assert cfg_of("--steps", "3", "--set", "epochs=2", "--set", "steps=5").steps == 5  # both in --set: steps
    assert cfg_of("--epochs", "2", "--set", "steps=4").steps == 4
