"""The pre-activation BiT ResNet (big_transfer's ResNetV2): names, sizes, the unit's algebra, the public surface."""

import pytest
import torch
import torch.nn.functional as F

from vitlab.errors import VitlabError
from vitlab.models.bit import BiTResNet, StdConv2d
from vitlab.models.config import ResNetConfig, ViTConfig


def _config(num_classes=5, **resnet):
    resnet = {"kind": "bit", **resnet}
    return ViTConfig(arch="resnet", resnet=ResNetConfig(**resnet), num_classes=num_classes, image_size=64, patch_size=1)


def _meta(config):
    with torch.device("meta"):
        return BiTResNet(config)


def _small(**kw):
    torch.manual_seed(0)
    return BiTResNet(_config(**{"layers": (1, 2), "base_width": 32, **kw}))


@pytest.mark.parametrize("layers,wf,classes,params", [
    ((3, 4, 6, 3), 1, 1000, 25_549_352),  # timm resnetv2_50x1_bit
    ((3, 4, 23, 3), 1, 1000, 44_541_480),  # resnetv2_101x1_bit
    ((3, 4, 6, 3), 3, 21843, 345_399_315),  # BiT-M-R50x3 (bit_pytorch head_size=21843)
    ((3, 8, 36, 3), 4, 21843, 1_107_299_923),  # BiT-M-R152x4
])
def test_parameter_counts_match_the_references(layers, wf, classes, params):
    model = _meta(_config(classes, layers=layers, width_factor=wf))
    assert sum(p.numel() for p in model.parameters()) == params
    assert not list(model.buffers())


def test_timm_key_names_and_shapes():
    sd = _meta(_config(1000)).state_dict()
    assert len(sd) == 153
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    assert shapes["stem.conv.weight"] == (64, 3, 7, 7)
    assert shapes["stages.0.blocks.0.downsample.conv.weight"] == (256, 64, 1, 1)
    assert shapes["stages.0.blocks.0.norm1.weight"] == (64,)  # the unit's input width (pre-activation)
    assert shapes["stages.0.blocks.1.norm1.weight"] == (256,)
    assert shapes["stages.1.blocks.0.conv2.weight"] == (128, 128, 3, 3)
    assert shapes["stages.1.blocks.0.conv3.weight"] == (512, 128, 1, 1)
    assert shapes["stages.1.blocks.0.norm3.weight"] == (128,)
    assert shapes["norm.weight"] == (2048,)
    assert shapes["head.weight"] == (1000, 2048) and shapes["head.bias"] == (1000,)
    assert not any(k.startswith("stages.0.blocks.1.downsample") for k in sd)
    assert "stem.norm.weight" not in sd


def test_shapes_zero_head_and_surface():
    model = _small().eval()
    assert model.num_features == 256
    x = torch.randn(2, 3, 64, 64)
    feats = model.forward_features(x)
    assert feats.shape == (2, 256, 8, 8)  # stem /4, one stride-2 stage
    assert (feats >= 0).all()  # after the pre-head GroupNorm + ReLU
    assert torch.equal(model.forward_head(feats, pre_logits=True), feats.mean(dim=(2, 3)))
    assert torch.equal(model(x), torch.zeros(2, 5))  # zero-initialised head at build
    model.reset_classifier(7)
    assert model.config.num_classes == 7 and model(x).shape == (2, 7) and not torch.any(model.head.weight)
    model.reset_classifier(0)
    assert model(x).shape == (2, 256)
    model.set_image_size(96)
    assert model.config.image_size == (96, 96) and model(torch.randn(1, 3, 96, 96)).shape == (1, 256)


def test_small_stem_keeps_resolution():
    model = _small(stem="small").eval()
    assert model.stem.conv.weight.shape[-1] == 3
    assert model.forward_features(torch.randn(1, 3, 32, 32)).shape == (1, 256, 16, 16)


def test_stem_pads_with_zeros_before_the_pool():
    """bit_pytorch pads the pool's input with zeros, not -inf: different at borders when all values are negative."""
    model = _small().eval()
    x = torch.randn(1, 3, 16, 16)
    conv = model.stem.conv(x)
    with torch.no_grad():
        want = F.max_pool2d(F.pad(conv, (1, 1, 1, 1), value=0.0), 3, 2)
        assert torch.equal(model.stem(x), want)
        neg = -conv.abs() - 1
        zero_pad = model.stem.pool(model.stem.pad(neg))
        inf_pad = F.max_pool2d(neg, 3, 2, padding=1)
        assert zero_pad[..., 0, 0].max() == 0 and not torch.equal(zero_pad, inf_pad)


def test_weight_standardisation_and_eps():
    conv = StdConv2d(4, 6, 3, eps=1e-10)
    with torch.no_grad():
        conv.weight.normal_(3.0, 2.0)
    w = conv.standardized_weight()
    assert torch.allclose(w.mean(dim=(1, 2, 3)), torch.zeros(6), atol=1e-5)
    assert torch.allclose(w.var(dim=(1, 2, 3), unbiased=False), torch.ones(6), atol=1e-4)
    assert _small().stem.conv.eps == 1e-10  # big_transfer's
    assert _small(ws_eps=1e-8).stages[1].blocks[0].conv2.eps == 1e-8  # timm's files


def test_unit_is_pre_activation_without_relu_after_add():
    """With its last GroupNorm zeroed a non-projecting unit is the identity, negative values included."""
    model = _small().eval()
    unit = model.stages[1].blocks[1]
    assert unit.downsample is None
    with torch.no_grad():
        unit.norm3.weight.zero_()
        unit.norm3.bias.zero_()
        x = torch.randn(2, 256, 4, 4)
        assert torch.equal(unit(x), x)
    first = model.stages[1].blocks[0]
    assert first.downsample is not None and first.conv2.stride == (2, 2) and first.conv1.stride == (1, 1)


def test_backward_and_wrong_kind():
    model = _small(num_classes=3)
    with torch.no_grad():
        model.head.weight.normal_()
    model(torch.randn(2, 3, 32, 32)).square().sum().backward()
    assert model.stem.conv.weight.grad is not None and model.stem.conv.weight.grad.abs().sum() > 0
    with pytest.raises(VitlabError, match="kind='bit'"):
        BiTResNet(ViTConfig(arch="resnet", resnet=ResNetConfig(), patch_size=1))


def test_build_model_dispatches_bit():
    from vitlab.models.registry import build_model

    assert isinstance(build_model(_config(layers=(1, 1), base_width=32)), BiTResNet)
