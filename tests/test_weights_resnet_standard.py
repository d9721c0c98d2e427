"""Standard ResNet weights against the real reference: transformers' ResNetForImageClassification
(random weights, randomised BatchNorm buffers) in and out; torchvision-named files; timm and native out."""

import json

import pytest
import torch
from safetensors.torch import load_file

import vitlab
from vitlab.errors import VitlabError
from vitlab.models import StandardResNet, create_model
from vitlab.weights import load_with_meta, save_hf, save_native, save_timm

transformers = pytest.importorskip("transformers")

# (layer_type, depths, embedding_size, hidden_sizes, channels, classes): the resnet-18 and resnet-50
# layouts (real depths, narrow widths to stay fast) and a 1-channel, 7-class net.
LAYOUTS = {
    "r18": ("basic", [2, 2, 2, 2], 16, [16, 32, 64, 128], 3, 1000),
    "r50": ("bottleneck", [3, 4, 6, 3], 16, [64, 128, 256, 512], 3, 10),
    "r26-gray": ("bottleneck", [2, 2, 2, 2], 32, [128, 256, 512, 1024], 1, 7),
}


def hf_model(layout, seed=0):
    layer_type, depths, emb, hidden, chans, classes = LAYOUTS[layout]
    cfg = transformers.ResNetConfig(num_channels=chans, embedding_size=emb, hidden_sizes=hidden, depths=depths,
                                    layer_type=layer_type, num_labels=classes,
                                    id2label={i: f"class {i}" for i in range(classes)},
                                    label2id={f"class {i}": i for i in range(classes)})
    torch.manual_seed(seed)
    model = transformers.ResNetForImageClassification(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # every BN tensor random, so a mapping mix-up (or eps) shows in the logits
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                n = m.num_features
                m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.copy_(torch.randn(n, generator=g) * 0.2)
                m.running_mean.copy_(torch.randn(n, generator=g) * 0.2)
                m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
        model.classifier[1].weight.normal_(0, 0.05, generator=g)
        model.classifier[1].bias.normal_(0, 0.05, generator=g)
    return model


def hf_logits(model, x):
    with torch.no_grad():
        return model(pixel_values=x).logits


@pytest.mark.parametrize("layout,safe", [("r18", True), ("r50", False), ("r26-gray", True)])
def test_hf_folder_loads_with_identical_logits(tmp_path, layout, safe):
    ref = hf_model(layout)
    ref.save_pretrained(tmp_path / "hf", safe_serialization=safe)
    if not safe and not (tmp_path / "hf" / "pytorch_model.bin").is_file():
        # transformers 5 writes safetensors whatever the flag: write the .bin layout of 4.x by hand
        (tmp_path / "hf" / "model.safetensors").unlink()
        torch.save(ref.state_dict(), tmp_path / "hf" / "pytorch_model.bin")
    assert (tmp_path / "hf" / ("model.safetensors" if safe else "pytorch_model.bin")).is_file()
    model, meta = load_with_meta(tmp_path / "hf")
    assert isinstance(model, StandardResNet) and not model.training
    layer_type, depths, emb, _, chans, classes = LAYOUTS[layout]
    r = model.config.resnet
    assert (r.block, list(r.layers), r.width, model.config.in_chans) == (layer_type, depths, emb, chans)
    assert meta["format"] == "hf" and meta["class_names"] == [f"class {i}" for i in range(classes)]
    x = torch.randn(2, chans, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_logits(ref, x), rtol=0, atol=1e-5)
    # and back out: transformers loads our export with identical logits
    save_hf(model, tmp_path / "out", class_names=meta["class_names"])
    again = transformers.ResNetForImageClassification.from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(hf_logits(again, x), hf_logits(ref, x), rtol=0, atol=1e-5)
    assert again.config.id2label[3] == "class 3"


def test_hf_preprocessing_and_refusals(tmp_path):
    ref = hf_model("r18")
    ref.save_pretrained(tmp_path / "hf")
    # microsoft/resnet-50's legacy ConvNext feature extractor (reference resnets.md 2.4)
    (tmp_path / "hf" / "preprocessor_config.json").write_text(json.dumps({
        "crop_pct": 0.875, "do_normalize": True, "do_resize": True, "feature_extractor_type": "ConvNextFeatureExtractor",
        "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225], "resample": 3, "size": 224}))
    _, meta = load_with_meta(tmp_path / "hf")
    pre = meta["preprocess"]
    assert (pre.resize, list(pre.image_size), pre.interpolation) == (256, [224, 224], "bicubic")
    assert list(pre.mean) == pytest.approx([0.485, 0.456, 0.406])
    # a bare HF state dict (no folder): detected by its `resnet.embedder` keys
    (tmp_path / "hf" / "model.safetensors").rename(tmp_path / "bare.safetensors")
    model, meta = load_with_meta(tmp_path / "bare.safetensors")
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_logits(ref, x), rtol=0, atol=1e-5)
    (tmp_path / "bare.safetensors").rename(tmp_path / "hf" / "model.safetensors")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "downsample_in_bottleneck": True}))
    with pytest.raises(VitlabError, match="downsample_in_bottleneck"):
        vitlab.load(tmp_path / "hf")


# resnets.md 2.3: HF -> torchvision names, written out here independently of vitlab's mapping
def torchvision_names(hf_sd):
    import re

    out = {}
    for k, v in hf_sd.items():
        k = k.removeprefix("resnet.")
        k = k.replace("embedder.embedder.convolution", "conv1").replace("embedder.embedder.normalization", "bn1")
        k = k.replace("classifier.1", "fc")
        k = re.sub(r"encoder\.stages\.(\d+)\.layers\.(\d+)\.", lambda m: f"layer{int(m[1]) + 1}.{m[2]}.", k)
        k = re.sub(r"layer\.(\d+)\.convolution", lambda m: f"conv{int(m[1]) + 1}", k)
        k = re.sub(r"layer\.(\d+)\.normalization", lambda m: f"bn{int(m[1]) + 1}", k)
        k = k.replace("shortcut.convolution", "downsample.0").replace("shortcut.normalization", "downsample.1")
        out[k] = v
    return out


def test_torchvision_file_without_bn_counters(tmp_path):
    ref = hf_model("r50")
    sd = {k: v for k, v in torchvision_names(ref.state_dict()).items() if not k.endswith("num_batches_tracked")}
    torch.save(sd, tmp_path / "resnet.pth")
    model, meta = load_with_meta(tmp_path / "resnet.pth")
    assert meta["format"] == "torchvision" and model.config.resnet.block == "bottleneck"
    pre = meta["preprocess"]  # torchvision V1: 256 -> 224, bilinear, ImageNet mean/std
    assert (pre.resize, list(pre.image_size), pre.interpolation) == (256, [224, 224], "bilinear")
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_logits(ref, x), rtol=0, atol=1e-5)
    # timm / torchvision out: the same names, strictly loadable into the HF-derived torchvision layout
    out = load_file(str(save_timm(model, tmp_path / "timm.safetensors")))
    assert set(out) == set(create_model("resnet-50", num_classes=10, base_width=16).state_dict())
    assert set(out) - set(sd) == {k for k in out if k.endswith("num_batches_tracked")}
    again = vitlab.load(tmp_path / "timm.safetensors")
    with torch.no_grad():
        assert torch.equal(again(x), model(x))


def test_native_round_trip_keeps_kind_block_width(tmp_path):
    model = create_model("resnet-18-small", num_classes=4, image_size=32, seed=0, base_width=16, layers=(1, 1)).eval()
    with torch.no_grad():
        model.bn1.running_mean.normal_()
    save_native(model, tmp_path / "m", class_names=list("abcd"))
    on_disk = json.loads((tmp_path / "m" / "config.json").read_text())["model"]["resnet"]
    assert (on_disk["kind"], on_disk["block"], on_disk["base_width"], on_disk["stem"]) == ("standard", "basic", 16, "small")
    loaded, meta = load_with_meta(tmp_path / "m")
    assert loaded.config == model.config and meta["class_names"] == list("abcd")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    with pytest.raises(VitlabError, match="small-stem"):
        save_hf(model, tmp_path / "hf")
    # fine-tuning surgery through load: a zero-initialised head for 2 classes
    tuned = vitlab.load(tmp_path / "m", num_classes=2)
    assert tuned.fc.out_features == 2 and torch.count_nonzero(tuned.fc.weight) == 0
