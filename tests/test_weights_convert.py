"""`vitlab convert`: the official fixture converted to native, Hugging Face (loaded by transformers) and
timm keeps the official logits."""

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import vitlab
from vitlab.cli import main

FIX = Path("/work/shared/fixtures/official")
pytestmark = pytest.mark.skipif(not FIX.is_dir(), reason="official fixtures not available")


def _io():
    with np.load(FIX / "tiny_token_prelinen.io.npz") as f:
        return torch.from_numpy(f["input_nchw"].astype(np.float32)), f["logits"]


def test_convert_official_to_native_hf_timm(tmp_path, capsys):
    src = str(FIX / "tiny_token_prelinen.npz")
    x, ref = _io()
    assert main(["convert", src, str(tmp_path / "native"), "--to", "native"]) == 0
    assert "wrote" in capsys.readouterr().out
    with torch.no_grad():
        assert np.abs(vitlab.load(tmp_path / "native")(x).numpy() - ref).max() < 1e-5

    assert main(["convert", src, str(tmp_path / "hf"), "--to", "hf", "--quiet"]) == 0
    transformers = pytest.importorskip("transformers")
    hf = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert np.abs(hf(pixel_values=x).logits.numpy() - ref).max() < 1e-5  # transformers reproduces the official logits

    assert main(["convert", src, str(tmp_path / "t.safetensors"), "--to", "timm", "--quiet"]) == 0
    sd = load_file(str(tmp_path / "t.safetensors"))
    assert {"cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.1.attn.qkv.weight", "norm.weight", "head.weight"} <= set(sd)
    m = vitlab.load(tmp_path / "t.safetensors")  # heads and GELU come back from the safetensors header
    assert m.config.gelu == "tanh" and m.config.heads == 4
    with torch.no_grad():
        assert np.abs(m(x).numpy() - ref).max() < 1e-5
    plain = {k: v for k, v in sd.items()}  # a header-less foreign timm file: timm's numerics (exact GELU),
    torch.save(plain, tmp_path / "t.pth")  # heads and pooling given (width 64 is no published width)
    m = vitlab.load(tmp_path / "t.pth", heads=4, classifier="token")
    assert m.config.gelu == "exact"
    with torch.no_grad():
        m = vitlab.load(tmp_path / "t.pth", heads=4, classifier="token", gelu="tanh")
        assert np.abs(m(x).numpy() - ref).max() < 1e-5


def test_convert_surgery_and_class_names(tmp_path, capsys):
    (tmp_path / "names.txt").write_text("\n".join(f"n{i}" for i in range(4)) + "\n")
    assert main(["convert", str(FIX / "tiny_token_linen.npz"), str(tmp_path / "ft"), "--num-classes", "4",
                 "--image-size", "48", "--class-names", str(tmp_path / "names.txt"), "--quiet"]) == 0
    model, meta = vitlab.weights.load_with_meta(tmp_path / "ft")
    assert model.config.num_classes == 4 and model.config.image_size == (48, 48)
    assert meta["class_names"] == ["n0", "n1", "n2", "n3"] and tuple(meta["preprocess"].image_size) == (48, 48)
    assert main(["convert", str(FIX / "tiny_token_linen.npz"), str(tmp_path / "x"), "--class-names",
                 str(tmp_path / "names.txt")]) == 2
    assert "4 class names" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "none.npz"), str(tmp_path / "y")]) == 2


@pytest.mark.parametrize("to", ["native", "timm", "hf"])
def test_names_the_weights_came_with_may_repeat_as_imagenets_do(tmp_path, capsys, to):
    """ImageNet-1k's list (google/vit-base-patch16-224's id2label) names two classes 'crane': convert refused to
    write such a model anywhere. The names come through as they are, with a note."""
    from vitlab.models.registry import create_model
    from vitlab.weights import save_hf

    names = ["crane", "bittern", "crane"]
    save_hf(create_model("custom", dim=16, depth=1, heads=2, mlp_dim=32, patch_size=4, image_size=8, num_classes=3),
            tmp_path / "src", class_names=names)
    dst = tmp_path / ("out.safetensors" if to == "timm" else "out")
    assert main(["convert", str(tmp_path / "src"), str(dst), "--to", to]) == 0
    out = capsys.readouterr().out
    assert "note: the class names 'crane' are each given to more than one output" in out
    assert ("label2id keeps one" in out) == (to == "hf")
    assert vitlab.weights.load_with_meta(dst)[1]["class_names"] == names


def test_convert_refuses_duplicate_class_names_and_says_what_hf_takes(tmp_path, capsys):
    """Duplicate names were accepted and HF's label2id silently kept one; a BiT ResNet's --to hf was told that
    'only plain ViTs' go there and that transformers lacks ViT hybrids."""
    from vitlab.models.registry import create_model
    from vitlab.weights import save_native

    save_native(create_model("custom", dim=16, depth=1, heads=2, mlp_dim=32, patch_size=4, image_size=8,
                             num_classes=3), tmp_path / "vit")
    (tmp_path / "names.txt").write_text("cat\ndog\ncat\n")
    assert main(["convert", str(tmp_path / "vit"), str(tmp_path / "hf"), "--to", "hf",
                 "--class-names", str(tmp_path / "names.txt")]) == 2
    assert "class names must differ: 'cat' given more than once" in capsys.readouterr().err
    save_native(create_model("bit-r50x1", num_classes=2, image_size=32), tmp_path / "bit")
    assert main(["convert", str(tmp_path / "bit"), str(tmp_path / "bit-hf"), "--to", "hf"]) == 2
    assert "--to hf writes ViTs and standard (torchvision-layout) ResNets" in capsys.readouterr().err
