"""The conv-stem ViT (Xiao et al. 2021): token grid for any input size, clear errors, weights round trip."""

import pytest
import torch
import torch.nn.functional as F

from vitlab.errors import VitlabError
from vitlab.models import ViTConfig
from vitlab.models.registry import create_model
from vitlab.weights import load_with_meta, save_hf, save_native, save_timm

ARGS = dict(conv_stem=[8, 16, 24], patch_size=1, dim=32, depth=2, heads=4, mlp_dim=64, classifier="gap",
            posemb="sincos2d", in_chans=1, num_classes=3)


def _model(image_size=28, **kw):
    return create_model("custom", seed=0, image_size=image_size, **{**ARGS, **kw}).eval()


@pytest.mark.parametrize("side", [9, 15, 16, 17, 28, 31, 33])
def test_grid_matches_the_feature_map_for_any_size(side):
    model = _model()
    features = model.patch_embed.stem(torch.zeros(1, 1, side, side + 3))
    assert features.shape[-2:] == model.config.grid_for((side, side + 3))
    assert model(torch.randn(2, 1, side, side + 3)).shape == (2, 3)


def test_28_pixels_give_16_tokens():
    cfg = ViTConfig(image_size=28, **ARGS)
    assert cfg.grid_size == (4, 4) and cfg.stride == 8 and cfg.is_hybrid


def test_stem_is_stride_two_convolutions_with_group_norm():
    model = _model()
    x = torch.randn(2, 1, 28, 28)
    y = x
    layers = list(model.patch_embed.stem)
    for conv, norm in zip(layers[0::3], layers[1::3]):
        y = F.relu(F.group_norm(F.conv2d(y, conv.weight, stride=2, padding=1), norm.num_groups,
                                norm.weight, norm.bias, eps=1e-6))
    tokens = F.conv2d(y, model.patch_embed.proj.weight, model.patch_embed.proj.bias).flatten(2).transpose(1, 2)
    with torch.no_grad():
        assert torch.allclose(model.patch_embed(x)[0], tokens, atol=1e-5)
    assert [m.num_groups for m in layers[1::3]] == [8, 16, 24]


def test_clear_errors():
    with pytest.raises(VitlabError, match="not a multiple of the patch size 2"):
        ViTConfig(image_size=28, **{**ARGS, "conv_stem": [8, 16], "patch_size": 2})  # 7x7 map
    with pytest.raises(VitlabError, match="two different stems"):
        ViTConfig(image_size=28, resnet={"layers": [], "stem": "small"}, **ARGS)
    with pytest.raises(VitlabError, match="positive"):
        ViTConfig(image_size=28, **{**ARGS, "conv_stem": [8, 0]})
    with pytest.raises(VitlabError, match="not a multiple of the total stride 4"):
        ViTConfig(image_size=30, patch_size=4)  # plain ViTs still need multiples of the patch


def test_native_round_trip_and_foreign_formats_refuse(tmp_path):
    model = _model()
    with torch.no_grad():
        model.head.weight.normal_()
    save_native(model, tmp_path / "m")
    loaded, _ = load_with_meta(tmp_path / "m")
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
    assert loaded.config == model.config and loaded.config.conv_stem == (8, 16, 24)
    with pytest.raises(VitlabError, match="no conv stem"):
        save_timm(model, tmp_path / "t.safetensors")
    with pytest.raises(VitlabError, match="only plain ViTs"):
        save_hf(model, tmp_path / "hf")


def test_bf16_stem_precision():
    from vitlab.train.precision import set_stem_precision

    model = _model()
    x = torch.randn(4, 1, 28, 28)
    with torch.no_grad():
        full = model.patch_embed.stem(x)
        set_stem_precision(model, "bf16-stem")
        half = model.patch_embed.stem(x)
        set_stem_precision(model, "fp32")
        again = model.patch_embed.stem(x)
    assert half.dtype == torch.float32 and not torch.equal(half, full)  # computed in bf16, handed back in fp32
    assert torch.allclose(half, full, atol=0.1) and torch.equal(again, full)
    plain = create_model("custom", dim=32, depth=1, heads=4, mlp_dim=64, patch_size=4, image_size=16, num_classes=3)
    with pytest.raises(VitlabError, match="needs a model with a conv stem"):
        set_stem_precision(plain, "bf16-stem")
