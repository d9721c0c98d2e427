"""Default output folders named after the model argument: evaluate kept a weights file's suffix
(eval-ViT-T.npz-test) where inspect dropped it, and a `custom(...)` spec gave a double dash (...-7--test)."""

from __future__ import annotations

import pytest

from vitlab.commands._load_args import model_folder_name, weights_folder_name


def test_a_weights_file_names_the_folder_without_its_suffix(tmp_path):
    weights = tmp_path / "ViT-T.npz"
    weights.write_bytes(b"x")
    assert weights_folder_name(str(weights)) == "ViT-T"
    assert weights_folder_name("vit-ti/16") == "16"  # not a file: its last path part, as before
    assert weights_folder_name(str(tmp_path / "missing.npz")) == "missing.npz"  # only an existing file is cut


@pytest.mark.parametrize("spec, name", [("custom(dim=32,patch_size=7)", "custom-dim-32-patch_size-7"),
                                        ("a,,b", "a-b"), ("()", "model"), ("my_run.v2", "my_run.v2")])
def test_folder_names_have_no_double_or_trailing_dashes(spec, name):
    assert model_folder_name(spec) == name


def test_evaluate_names_its_folder_without_the_file_suffix(tmp_path, monkeypatch, capsys):
    import vitlab
    from vitlab.cli import main
    from vitlab.weights import save_timm

    model = vitlab.create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=4, image_size=16,
                                num_classes=3, seed=0)
    save_timm(model, tmp_path / "ViT-T.safetensors")
    monkeypatch.chdir(tmp_path)
    assert main(["evaluate", "ViT-T.safetensors", "--data", "bundled", "--quiet", "--batch-size", "64"]) == 0
    assert (tmp_path / "eval-ViT-T-test" / "metrics.json").is_file()
    assert not (tmp_path / "eval-ViT-T.safetensors-test").exists()
