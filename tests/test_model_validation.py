"""Model configs are typed and bounded where they are made (ViTConfig / ResNetConfig), named models
catch near-miss names, and ResNet width factors may be fractional with the official rounding."""

import numpy as np
import pytest
import torch

import vitlab
from test_weights_hybrid import hybrid_arrays  # the official hybrid layout, any root width
from vitlab import limits
from vitlab.errors import VitlabError
from vitlab.models.config import ResNetConfig, ViTConfig
from vitlab.models.registry import count_parameters, create_model, get_config, model_names


@pytest.mark.parametrize("kw,words", [
    (dict(image_size=0), "image_size"),
    (dict(image_size=(32, "a")), "image_size"),
    (dict(image_size=8192), "image_size"),
    (dict(depth=-1), "depth"),
    (dict(depth=200000), "depth must be an integer from 1 to 256"),
    (dict(heads=-2), "heads"),
    (dict(heads=5), "not divisible by heads=5"),
    (dict(num_classes=-1), "num_classes"),
    (dict(drop_path=-0.1), "drop_path"),
    (dict(drop_path=1.0), "drop_path"),
    (dict(dropout=float("nan")), "dropout"),
    (dict(attention_dropout="0.1"), "attention_dropout"),
    (dict(layer_norm_eps=0), "layer_norm_eps"),
    (dict(dim=0), "dim"),
    (dict(dim=100_000, heads=10), "dim"),
    (dict(mlp_dim=0), "mlp_dim"),
    (dict(patch_size=0), "patch_size"),
    (dict(in_chans=0), "in_chans"),
    (dict(in_chans=True), "in_chans"),
    (dict(representation_size=-1), "representation_size"),
    (dict(qkv_bias="yes"), "qkv_bias"),
    (dict(conv_stem=[8] * 9, patch_size=1), "conv_stem"),
    (dict(conv_stem=[8, -16], patch_size=1), "conv_stem"),
    (dict(resnet={"layers": [1], "widht_factor": 2}), "unknown ResNet config fields ['widht_factor']"),
    (dict(resnet=5), "resnet must be"),
])
def test_create_model_validates_its_arguments_in_one_line(kw, words):
    kw = dict(kw)
    with pytest.raises(VitlabError) as info:
        create_model("vit-ti/16", num_classes=kw.pop("num_classes", 10), image_size=kw.pop("image_size", 32), **kw)
    message = str(info.value)
    assert words in message and "\n" not in message, message


def test_custom_models_with_any_patch_size_still_build():
    model = create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=4, image_size=28, in_chans=1,
                         num_classes=10, seed=0)
    assert model.config.patch_size == 4
    assert get_config("custom", patch_size=61, image_size=61).grid_size == (1, 1)
    assert get_config("vit-b/16", patch_size=4, image_size=32).patch_size == 4  # an explicit override is free


def test_near_miss_model_names_get_a_suggestion():
    with pytest.raises(VitlabError, match=r"patch size 61 .*\(did you mean 'vit-b/16'.*custom") as info:
        get_config("vit-b/61")
    assert "\n" not in str(info.value)
    with pytest.raises(VitlabError, match=r"unknown model 'vit-b16' \(did you mean 'vit-b/16'"):
        get_config("vit-b16")
    with pytest.raises(VitlabError, match=r"unknown model 'resnet-5O' \(did you mean 'resnet-50'"):
        get_config("resnet-5O")
    with pytest.raises(VitlabError, match="unknown model"):
        get_config("vit-q/16")


def test_every_registered_name_still_resolves():
    for name in model_names() + ["vit-mu/8", "vit-mu/16", "vit-mu/32", "ViT-B_16", "vit_b/16", "vit-s/32-gap",
                                 "resnet50", "resnetv2_50x1_bit", "BiT-M-R50x1", "bit-r26x1-postact-small"]:
        cfg = get_config(name)
        assert cfg.name


def test_config_json_numbers_are_normalised():
    """JSON may write 12.0 for an int; a bool is not a number here."""
    cfg = ViTConfig.from_dict({"depth": 2.0, "dim": 64, "heads": 4, "mlp_dim": 128, "image_size": [32.0, 32],
                               "patch_size": 8})
    assert cfg.depth == 2 and isinstance(cfg.depth, int) and cfg.image_size == (32, 32)
    assert ViTConfig(depth=np.int64(3)).depth == 3
    with pytest.raises(VitlabError, match="depth"):
        ViTConfig(depth=2.5)
    with pytest.raises(VitlabError, match="unknown model config fields"):
        ViTConfig.from_dict({"deph": 2})


def test_limits_sit_above_the_largest_published_models():
    for name, size in (("vit-h/14", 518), ("r50+vit-l/32", 512), ("bit-r152x4", 480), ("resnet-152", 224)):
        get_config(name, image_size=size)
    big_vision_e = ViTConfig(dim=1792, depth=56, mlp_dim=15360, heads=16, patch_size=14, image_size=224)
    assert big_vision_e.depth <= limits.MAX_DEPTH and big_vision_e.mlp_dim <= limits.MAX_MLP_DIM


# ---------------------------------------------------------------------------- ResNet width factor
def test_resnet_config_bounds():
    for kw, words in [(dict(width_factor=0), "width_factor"), (dict(width_factor=-1), "width_factor"),
                      (dict(width_factor=float("inf")), "width_factor"), (dict(width_factor=0.25), "multiple of 32"),
                      (dict(layers=(1000,)), "ResNet layers"), (dict(layers=(1,) * 9), "at most 8"),
                      (dict(layers=3), "ResNet layers"), (dict(base_width=0), "base_width"),
                      (dict(ws_eps=0), "ws_eps"), (dict(width_factor=64.0), "channels")]:
        with pytest.raises(VitlabError, match=words):
            ResNetConfig(**kw)


def test_fractional_width_factor_follows_the_official_rounding():
    """vit_jax/models_vit.py: width = int(64 * width_factor); stage i is width * 2**i wide, 4x that out."""
    half = ResNetConfig(width_factor=0.5)
    assert half.width == int(64 * 0.5) == 32
    assert ResNetConfig(width_factor=1.5).width == int(64 * 1.5) == 96
    assert ResNetConfig(width_factor=1.0) == ResNetConfig(width_factor=1) and ResNetConfig(width_factor=1.0).width_factor == 1
    model = create_model("r26+vit-s/32", num_classes=3, image_size=64, depth=1, resnet={"layers": [1, 1], "width_factor": 0.5})
    stages = model.patch_embed.backbone.stages
    for s, stage in enumerate(stages):
        unit = stage.blocks[0]
        assert unit.conv1.out_channels == 32 * 2**s and unit.conv3.out_channels == 4 * 32 * 2**s
    assert model.patch_embed.proj.in_channels == 4 * 32 * 2
    for name in ("bit-r50x1", "bit-r50x1-postact", "resnet-50"):  # the three ResNet families
        m = create_model(name, num_classes=2, image_size=32, width_factor=0.5, layers=(1, 1), seed=0).eval()
        assert m.config.resnet.width == 32
        with torch.no_grad():
            assert m(torch.randn(1, 3, 32, 32)).shape == (1, 2)


def test_official_hybrid_with_width_factor_one_half_loads(tmp_path):
    """Root width 32 is width factor 0.5 (the official int(64 * 0.5)); it used to be 32 // 64 = 0."""
    layers = (1, 2)
    a = hybrid_arrays(layers, np.random.default_rng(0), dim=16, heads=2, mlp=32, width=32, classes=3)
    np.savez(tmp_path / "half.npz", **a)
    model = vitlab.load(tmp_path / "half.npz")
    cfg = model.config
    assert cfg.resnet.width_factor == 0.5 and cfg.resnet.width == 32 and cfg.resnet.layers == layers
    assert cfg.image_size == (2 * 8, 2 * 8)  # 2x2 grid, stem /4 and one strided stage /2
    assert count_parameters(model) == sum(v.size for v in a.values())  # every array used, nothing else built
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        out = model(x)
    assert out.shape == (2, 3) and torch.isfinite(out).all()
    vitlab.weights.save_native(model, tmp_path / "native")  # and the config round-trips with a float factor
    again = vitlab.load(tmp_path / "native")
    assert again.config == cfg
    with torch.no_grad():
        assert torch.equal(again(x), out)
