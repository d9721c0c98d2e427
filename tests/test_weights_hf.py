"""Hugging Face in and out, checked against transformers itself (a test dependency)."""

import json

import pytest
import torch

import vitlab
from vitlab.models.registry import create_model
from vitlab.weights import load_with_meta, save_hf

transformers = pytest.importorskip("transformers")


def _randomise(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def _hf_config(**kw):
    args = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
                patch_size=4, num_labels=5)
    args.update(kw)
    return transformers.ViTConfig(**args)


def _images(n=2, c=3, s=16):
    return torch.randn(n, c, s, s, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kw", [{}, {"layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh"},
                                {"qkv_bias": False, "num_channels": 1}])
def test_hf_save_pretrained_loads_with_same_logits(tmp_path, kw):
    hf = _randomise(transformers.ViTForImageClassification(_hf_config(**kw)))
    hf.save_pretrained(tmp_path / "hf")  # transformers writes the 4.x (checkpoint) key layout
    model, meta = load_with_meta(tmp_path / "hf")
    x = _images(c=hf.config.num_channels)
    with torch.no_grad():
        ref = hf(pixel_values=x).logits
        out = model(x)
    assert (out - ref).abs().max().item() < 1e-5
    assert meta["format"] == "hf"
    assert model.config.layer_norm_eps == hf.config.layer_norm_eps


def test_hf_5x_in_memory_layout_and_class_names(tmp_path):
    from safetensors.torch import save_file

    cfg = _hf_config(id2label={i: f"c{i}" for i in range(5)}, label2id={f"c{i}": i for i in range(5)})
    hf = _randomise(transformers.ViTForImageClassification(cfg), seed=3)
    folder = tmp_path / "hf5"
    folder.mkdir()
    sd = hf.state_dict()
    assert any(".layers.0.attention.q_proj." in k for k in sd)  # the 5.x names
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
    cfg.to_json_file(str(folder / "config.json"))
    model, meta = load_with_meta(folder)
    x = _images()
    with torch.no_grad():
        assert (model(x) - hf(pixel_values=x).logits).abs().max().item() < 1e-5
    assert meta["class_names"] == [f"c{i}" for i in range(5)]


def test_hf_vitmodel_pooler_without_prefix_and_bin(tmp_path):
    hf = _randomise(transformers.ViTModel(_hf_config()), seed=4)
    folder = tmp_path / "base"
    folder.mkdir()
    hf.config.to_json_file(str(folder / "config.json"))
    legacy = {}
    for k, v in hf.state_dict().items():  # write the 4.x names into pytorch_model.bin by hand
        k = (k.replace("layers.", "encoder.layer.").replace("attention.q_proj", "attention.attention.query")
             .replace("attention.k_proj", "attention.attention.key").replace("attention.v_proj", "attention.attention.value")
             .replace("attention.o_proj", "attention.output.dense").replace("mlp.fc1", "intermediate.dense")
             .replace("mlp.fc2", "output.dense"))
        legacy[k] = v
    assert not any(k.startswith("vit.") for k in legacy)
    torch.save(legacy, folder / "pytorch_model.bin")
    model = vitlab.load(folder)
    x = _images()
    with torch.no_grad():
        ref = hf(pixel_values=x)
        feats = model.forward_features(x)
        assert (feats - ref.last_hidden_state).abs().max().item() < 1e-5
        assert (model(x) - ref.pooler_output).abs().max().item() < 1e-5  # pooler = representation layer


@pytest.mark.parametrize("gelu,eps", [("tanh", 1e-6), ("exact", 1e-12)])
def test_hf_export_loads_in_transformers(tmp_path, gelu, eps):
    model = _randomise(create_model("custom", dim=32, depth=2, heads=4, mlp_dim=64, patch_size=4, image_size=16,
                                    num_classes=3, gelu=gelu, layer_norm_eps=eps), seed=5)
    save_hf(model, tmp_path / "out", class_names=["cat", "dog", "eel"])
    hf = transformers.ViTForImageClassification.from_pretrained(tmp_path / "out").eval()
    x = _images()
    with torch.no_grad():
        assert (hf(pixel_values=x).logits - model(x)).abs().max().item() < 1e-5
    assert hf.config.id2label[2] == "eel"
    pre = json.loads((tmp_path / "out" / "preprocessor_config.json").read_text())
    assert pre["image_mean"] == [0.5, 0.5, 0.5]
    proc = transformers.ViTImageProcessor.from_pretrained(tmp_path / "out")
    assert proc.size["height"] == 16
    # and back into vitlab unchanged
    again = vitlab.load(tmp_path / "out")
    with torch.no_grad():
        assert (again(x) - model(x)).abs().max().item() < 1e-5


def test_hf_export_refuses_what_hf_cannot_hold(tmp_path):
    gap = create_model("custom", dim=32, depth=1, heads=4, mlp_dim=64, patch_size=4, image_size=16,
                       num_classes=3, classifier="gap")
    with pytest.raises(vitlab.VitlabError, match="class token"):
        save_hf(gap, tmp_path / "x")
    hybrid = create_model("r+vit-ti/16", num_classes=3, image_size=64, depth=1)
    with pytest.raises(vitlab.VitlabError, match="hybrid"):
        save_hf(hybrid, tmp_path / "y")


def test_hf_preprocessor_config_is_used(tmp_path):
    hf = _randomise(transformers.ViTForImageClassification(_hf_config()))
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": 16, "width": 16},
         "resample": 3, "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}))
    _, meta = load_with_meta(tmp_path / "hf")
    pre = meta["preprocess"]
    assert tuple(pre.mean) == (0.485, 0.456, 0.406) and pre.interpolation == "bicubic"
    assert tuple(pre.image_size) == (16, 16) and pre.resize is None
