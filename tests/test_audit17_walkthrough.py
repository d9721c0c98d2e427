"""Audit 17: a new user's walk through README.md and docs/ on a fresh clone. Each test pins one defect that walk
found."""

import pytest
import torch
import yaml

from vitlab.models import create_model
from vitlab.train import resolve_config, train

pytestmark = pytest.mark.usefixtures("keep_torch_threads")  # tests/conftest.py


def _tiny_settings(tmp_path, **kw):
    return dict(data="bundled", classes=["Sandal", "Sneaker", "Ankle boot"], per_class=4, batch_size=6,
                out_dir=str(tmp_path), precision="fp32", threads=1, device="cpu", quiet=True, **kw)


def test_docs_training_python_resume_of_a_given_model(tmp_path):
    # docs/training.md "From Python": a model handed to train(cfg, model=...) and resumed from its config.yaml. The
    # docs' model is create_model("custom", ..., patch_size=16, num_classes=10): 3 channels (grey data is converted)
    # and the registry's patch 16. config.yaml left out both (in_chans as "the data's", patch_size as the registry
    # default), the resume built a 1-channel, 4-pixel-patch small-data ViT and stopped: "checkpoint ... does not fit
    # the model this command builds".
    mine = create_model("custom", dim=16, depth=1, heads=2, mlp_dim=32, patch_size=16, num_classes=10)
    result = train(resolve_config("small-data", overrides=_tiny_settings(tmp_path, steps=2, name="api")), model=mine)
    run = result.run_dir
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert recorded["model_args"] == dict(dim=16, depth=1, heads=2, mlp_dim=32, patch_size=16, in_chans=3)
    resumed = train(resolve_config(yaml_path=run / "config.yaml", overrides={"resume": str(run)}))
    assert resumed.model.config.in_chans == 3 and resumed.model.config.patch_size == 16
    for a, b in zip(result.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)


def test_a_given_small_data_vit_is_recorded_as_one(tmp_path):
    # a guard for the fix above: a given model that is the small-data ViT itself (which training builds for "custom"
    # with no model_args) records only its channels, and `--config RUN/config.yaml` builds the same model
    mine = create_model("custom", dim=64, depth=6, heads=4, mlp_dim=128, patch_size=4, image_size=28, in_chans=1,
                        num_classes=3)
    result = train(resolve_config("small-data", overrides=_tiny_settings(tmp_path, steps=1, name="a")), model=mine)
    recorded = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert recorded["model_args"] == {"in_chans": 1}
    again = train(resolve_config(yaml_path=result.run_dir / "config.yaml", overrides={"name": "b"}))
    assert sum(p.numel() for p in again.model.parameters()) == sum(p.numel() for p in mine.parameters())


def test_a_width_the_heads_do_not_divide_names_where_the_heads_came_from_only_when_true(tmp_path, capsys):
    # `vitlab train --model custom --model-args dim=30` said "dim=30 is not divisible by heads=4; ... (a model not
    # named by its size, such as custom, starts from ViT-B's 12 heads)": training's custom has the small-data ViT's 4
    from vitlab.cli import main

    assert main(["train", "--data", "digits", "--model", "custom", "--model-args", "dim=30", "--steps", "1",
                 "--out", str(tmp_path)]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("vitlab train: error: dim=30 is not divisible by heads=4;") and "ViT-B" not in line
    assert main(["evaluate", "custom(dim=30)", "--data", "digits"]) == 2  # the registry's custom: ViT-B's 12 heads
    assert "starts from ViT-B's 12 heads" in capsys.readouterr().err
