"""Standard BatchNorm ResNets (torchvision v1.5): parameter counts, MACs, registry names, surface, BN in training."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.errors import VitlabError
from vitlab.models import StandardResNet, create_model, get_config
from vitlab.models.registry import analytic_macs, count_parameters, model_names


@pytest.mark.parametrize("name,params,entries", [
    # torchvision's resnet18/34/50/101/152 (reference resnets.md 1.1: parameters, state_dict entries)
    ("resnet-18", 11_689_512, 122),
    ("resnet-34", 21_797_672, 218),
    ("resnet-50", 25_557_032, 320),
    ("resnet-101", 44_549_160, 626),
    ("resnet-152", 60_192_808, 932),
])
def test_parameter_counts_match_torchvision(name, params, entries):
    with torch.device("meta"):
        model = create_model(name, num_classes=1000)
    assert isinstance(model, StandardResNet)
    assert count_parameters(model) == params
    assert len(model.state_dict()) == entries


@pytest.mark.parametrize("name,gmacs", [("resnet-18", 1.814), ("resnet-50", 4.089), ("resnet-152", 11.514)])
def test_macs_match_torchvision_gflops(name, gmacs):
    # torchvision's weights meta quotes multiply-accumulates as "GFLOPS" at 224 px
    assert analytic_macs(get_config(name)) / 1e9 == pytest.approx(gmacs, rel=0.01)


def test_torchvision_key_names_and_shapes():
    with torch.device("meta"):
        sd = create_model("resnet-50").state_dict()
        sd18 = create_model("resnet-18").state_dict()
    assert sd["conv1.weight"].shape == (64, 3, 7, 7)
    assert sd["layer1.0.downsample.0.weight"].shape == (256, 64, 1, 1)
    assert sd["layer2.0.conv2.weight"].shape == (128, 128, 3, 3)
    assert sd["layer4.2.conv3.weight"].shape == (2048, 512, 1, 1)
    assert sd["fc.weight"].shape == (1000, 2048) and sd["bn1.num_batches_tracked"].dtype == torch.long
    assert "layer1.0.downsample.0.weight" not in sd18  # basic blocks: no projection in the first stage
    assert sd18["layer2.0.conv1.weight"].shape == (128, 64, 3, 3)
    assert sd18["layer2.0.downsample.0.weight"].shape == (128, 64, 1, 1)


def test_v15_stride_on_the_3x3_and_feature_maps():
    model = create_model("resnet-50", num_classes=10, image_size=64, seed=0, layers=(1, 1, 1, 1)).eval()
    assert model.layer2[0].conv1.stride == (1, 1) and model.layer2[0].conv2.stride == (2, 2)
    assert model.conv1.stride == (2, 2) and isinstance(model.maxpool, nn.MaxPool2d)
    with torch.no_grad():
        assert model.forward_features(torch.randn(1, 3, 64, 64)).shape == (1, 2048, 2, 2)
        assert model.forward_features(torch.randn(1, 3, 50, 70)).shape == (1, 2048, 2, 3)  # any size works
    assert model.config.stride == 32


def test_small_stem_width_and_overrides():
    model = create_model("resnet-18-small", num_classes=10, image_size=32, in_chans=1, seed=0,
                         base_width=16, layers=(1, 1, 1)).eval()
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1) and model.conv1.out_channels == 16
    assert isinstance(model.maxpool, nn.Identity)
    assert model.num_features == 64 and model.config.stride == 4
    with torch.no_grad():
        assert model.forward_features(torch.randn(2, 1, 32, 32)).shape == (2, 64, 8, 8)
    wide = get_config("resnet-50", width_factor=2).resnet
    assert wide.width == 128 and wide.kind == "standard" and wide.block == "bottleneck"
    assert get_config("resnet-50", stem="small").resnet.stem == "small"


def test_surface_head_and_reset_classifier():
    model = create_model("resnet-18-small", num_classes=5, image_size=32, seed=0, layers=(1, 1)).eval()
    assert model.head is model.fc
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        feats = model.forward_features(x)
        assert torch.equal(model.forward_head(feats, pre_logits=True), feats.mean(dim=(2, 3)))
        assert torch.allclose(model(x), model.fc(feats.mean(dim=(2, 3))))
    model.reset_classifier(3)
    assert model.head is model.fc and model.fc.out_features == 3 and model.config.num_classes == 3
    assert torch.count_nonzero(model.fc.weight) == 0 and torch.count_nonzero(model.fc.bias) == 0
    model.set_image_size(48)
    assert model.config.image_size == (48, 48)


def test_torchvision_init():
    model = create_model("resnet-18-small", num_classes=5, image_size=32, seed=0, layers=(1, 1))
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(torch.all(m.weight == 1) and torch.all(m.bias == 0) for m in bns)
    assert all(m.eps == 1e-5 and m.momentum == 0.1 for m in bns)
    w = model.layer1[0].conv1.weight  # kaiming normal, fan_out = 64 * 9: std sqrt(2 / 576)
    assert w.std().item() == pytest.approx((2 / (64 * 9)) ** 0.5, rel=0.1)


def test_registry_families_and_old_names():
    names = model_names()
    for n in ("resnet-18", "resnet-26", "resnet-34", "resnet-50", "resnet-101", "resnet-152",
              "bit-r50x1", "bit-r152x4", "bit-r50x1-postact"):
        assert n in names
    assert get_config("resnet-26").resnet.layers == (2, 2, 2, 2)
    assert get_config("resnet-34").resnet.block == "basic"
    post = get_config("bit-r50x1-postact-small", layers=(1, 1), width_factor=2)
    assert (post.resnet.kind, post.resnet.stem, post.resnet.layers, post.resnet.width) == ("bit-post", "small", (1, 1), 128)
    pre = get_config("bit-r152x4")
    assert (pre.resnet.kind, pre.resnet.layers, pre.resnet.width_factor) == ("bit", (3, 8, 36, 3), 4)
    with pytest.raises(VitlabError, match=r"bit-r50x2.*bit-r50x2-postact"):
        get_config("resnet-50x2")
    with pytest.raises(VitlabError, match="bit-r26x1-small"):
        get_config("resnet-26x1-small")
    with pytest.raises(VitlabError, match="unknown ResNet depth"):
        get_config("resnet-77")


def test_bn_training_step_updates_statistics():
    torch.manual_seed(0)
    model = create_model("resnet-18-small", num_classes=3, image_size=16, seed=0, layers=(1, 1)).train()
    before = model.bn1.running_mean.clone()
    x, y = torch.randn(8, 3, 16, 16), torch.arange(8) % 3
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and not torch.equal(before, model.bn1.running_mean)
    assert int(model.bn1.num_batches_tracked) == 1


def _tiny_data():
    from vitlab.data.dataset import DataSplits, ImageDataset

    g = torch.Generator().manual_seed(0)
    classes = ["a", "b"]

    def make(n):
        labels = torch.arange(n) % 2
        images = torch.randint(0, 255, (n, 1, 8, 8), generator=g, dtype=torch.uint8)
        return ImageDataset(images, labels, classes, name="tiny")

    return DataSplits(make(16), make(8), None, classes, name="tiny", channels=1)


def _bn_buffers(model):
    return {k: v.clone() for k, v in model.state_dict().items() if "running_" in k}


@pytest.mark.parametrize("mode", ["train", "frozen", "sync"])
def test_train_loop_batchnorm_modes(tmp_path, mode, capsys):
    from vitlab.train import resolve_config, train

    model = create_model("resnet-18-small", num_classes=2, image_size=8, in_chans=1, seed=0, base_width=8, layers=(1,))
    before = _bn_buffers(model)
    weight = model.bn1.weight.detach().clone()
    cfg = resolve_config("small-data", overrides=dict(
        data="tiny", out_dir=str(tmp_path), name=mode, steps=2, batch_size=16, lr=0.1, warmup_steps=0, threads=1,
        quiet=True, inception_crop=False, hflip=False, eval_batch_size=8, save_model=False, batchnorm=mode,
        precision="fp32", epochs=0, device="cpu"))
    result = train(cfg, model=model, data=_tiny_data())  # 2 epochs of one step, evaluated in between
    after = _bn_buffers(result.model)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    if mode == "frozen":  # statistics kept, affine parameters still learn
        assert changed == []
        assert not torch.equal(weight, result.model.bn1.weight.detach())
    else:  # "sync" on one CPU process is plain BN, said in one line
        assert len(changed) == len(before)
    if mode == "sync":
        assert "batchnorm=sync" in capsys.readouterr().err


def test_batchnorm_setting_is_validated():
    from vitlab.train import resolve_config

    with pytest.raises(VitlabError, match="batchnorm must be"):
        resolve_config("small-data", overrides=dict(batchnorm="off"))


def test_peer_names_reach_the_right_family():
    """timm / torchvision / big_transfer spellings build the model they name."""
    assert get_config("resnet50").resnet == get_config("resnet-50").resnet
    assert get_config("ResNet18").resnet.block == "basic"
    bit = get_config("resnetv2_152x2_bit").resnet
    assert (bit.kind, bit.layers, bit.width_factor) == ("bit", (3, 8, 36, 3), 2)
    assert get_config("BiT-M-R50x1").resnet == get_config("bit-r50x1").resnet


@pytest.mark.parametrize("name", ["resnet-18", "bit-r50x1", "bit-r50x1-postact"])
def test_return_attention_on_a_cnn_says_why_in_one_line(name):
    model = create_model(name, num_classes=3, image_size=32).eval()
    with pytest.raises(VitlabError, match="convolutional network and has no attention maps"):
        model(torch.zeros(1, 3, 32, 32), return_attention=True)
    assert model(torch.zeros(1, 3, 32, 32), return_attention=False).shape == (1, 3)
