"""Audit of the model API as a timm / Hugging Face user meets it (after test_audit_api_python.py): timm's second
argument of `reset_classifier`, the ResNets' input check, `pretrained_cfg` (what timm's transforms read), a
`torch.jit.script` refusal, the hybrids' ResNet overrides, and a load -> save round trip that keeps the
preprocessing and class names.

Facts about timm 1.0.31 (torch 2.14.1) used below were checked in a separate environment; timm is not imported here.
"""

import math

import pytest
import torch

import vitlab
from vitlab.errors import VitlabError
from vitlab.weights import load_with_meta

IMAGENET_MEAN = (0.485, 0.456, 0.406)


def tiny_vit(**kw):
    kw = {"num_classes": 3, "image_size": 32, "depth": 1, "dim": 64, "heads": 2, "mlp_dim": 128, **kw}
    return vitlab.create_model(kw.pop("name", "vit-ti/16"), seed=0, **kw)


def tiny_resnet(name="resnet-18", **kw):
    return vitlab.create_model(name, num_classes=3, image_size=32, base_width=32, layers=(1, 1), seed=0, **kw)


# ---------------------------------------------------------------------------------------- reset_classifier
# timm: reset_classifier(num_classes, global_pool=None) on ViT, ResNet and ResNetV2 alike, and a timm ViT switches
# its pooling there. vitlab's second positional argument used to be keep_representation, so `reset_classifier(10,
# 'avg')` silently kept a representation layer and the class-token pooling.

def test_reset_classifier_refuses_a_pooling_the_model_was_not_built_with():
    model = tiny_vit()
    with pytest.raises(VitlabError, match=r"global_pool='avg'.*pools with 'token'.*classifier='gap'"):
        model.reset_classifier(10, "avg")
    assert model.num_classes == 3  # nothing changed
    with pytest.raises(VitlabError, match="pools with 'avg'"):
        tiny_resnet().reset_classifier(10, "max")


@pytest.mark.parametrize("make, pool", [(lambda: tiny_vit(), "token"), (lambda: tiny_vit(classifier="gap"), "avg"),
                                        (lambda: tiny_vit(classifier="gap"), "gap"), (lambda: tiny_resnet(), "avg"),
                                        (lambda: tiny_resnet("bit-r26x1"), "avg")])
def test_reset_classifier_takes_the_models_own_pooling_by_timms_name(make, pool):
    model = make()
    model.reset_classifier(5, pool)
    assert model.num_classes == 5 and model.get_classifier().out_features == 5


def test_keep_representation_is_by_name_only():
    model = tiny_vit(representation_size=32)
    with pytest.raises(VitlabError, match="keep_representation=True by name"):
        model.reset_classifier(4, True)
    model.reset_classifier(4, keep_representation=True)
    assert model.pre_logits is not None and model.head.in_features == 32


# ------------------------------------------------------------------------------------- the ResNets' input
@pytest.mark.parametrize("name", ["resnet-18", "bit-r26x1", "bit-r26x1-postact"])
def test_resnets_name_a_wrong_input_in_one_line(name):
    model = tiny_resnet(name).eval()
    # before: PyTorch's "Given groups=1, weight of size [32, 3, 7, 7], expected input ... to have 3 channels"
    with pytest.raises(VitlabError, match=r"expected images of shape \(B, 3, H, W\), got \(2, 1, 32, 32\).*in_chans=3"):
        model(torch.zeros(2, 1, 32, 32))
    with pytest.raises(VitlabError, match=r"got \(3, 32, 32\) \(one image: add the batch dimension"):
        model.forward_features(torch.zeros(3, 32, 32))
    assert model(torch.zeros(0, 3, 32, 32)).shape == (0, 3)  # an empty batch still runs, as in timm


# --------------------------------------------------------------------------------------- torch.jit.script
@pytest.mark.filterwarnings("ignore")
def test_jit_script_is_refused_with_what_works_instead():
    for model in (tiny_vit(), tiny_resnet()):
        # before: TorchScript's "try blocks aren't supported" / "Unknown type name 'nn.Module'" tracebacks
        with pytest.raises(VitlabError, match=r"torch\.jit\.script.*torch\.jit\.trace.*torch\.compile"):
            torch.jit.script(model)
    model = tiny_vit().eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        traced = torch.jit.trace(model, x, check_trace=False)
        assert torch.allclose(traced(x), model(x), atol=1e-5)


# ------------------------------------------------------------------------------------------ pretrained_cfg
# timm.data.resolve_model_data_config(model) reads `model.pretrained_cfg`; for a model without one (vitlab's, before)
# it returned input_size (3, 224, 224) and ImageNet's mean/std with crop_pct 0.875, even for a ViT at 384 px with
# [-1, 1] inputs. With the dict below, timm's create_transform(**cfg) gave the same pixels as vitlab's Preprocess
# within one grey level (PIL vs torch resize) for the four records tested here (checked with timm 1.0.31).

def test_pretrained_cfg_describes_the_models_input_for_timms_transforms():
    model = vitlab.create_model("vit-ti/16", image_size=(64, 96), depth=1, num_classes=7)
    cfg = model.pretrained_cfg
    assert cfg["input_size"] == (3, 64, 96) and cfg["num_classes"] == 7
    assert cfg["mean"] == cfg["std"] == (0.5, 0.5, 0.5)  # vitlab's default: [-1, 1] as the paper
    assert cfg["crop_pct"] == 1.0 and cfg["crop_mode"] == "squash"  # a plain resize of the whole image
    assert cfg["first_conv"] == "patch_embed.proj" and cfg["classifier"] == "head"
    assert model.default_cfg == cfg
    one = vitlab.create_model("resnet-18-small", num_classes=10, image_size=28, in_chans=1, base_width=16,
                              layers=(1, 1))
    assert one.pretrained_cfg["input_size"] == (1, 28, 28) and one.pretrained_cfg["mean"] == (0.5,)
    assert (one.pretrained_cfg["first_conv"], one.pretrained_cfg["classifier"]) == ("conv1", "fc")
    hybrid = vitlab.create_model("r+vit-ti/16", image_size=64, depth=1)
    assert hybrid.pretrained_cfg["first_conv"] == "patch_embed.backbone.stem.conv"


@pytest.mark.parametrize("image, resize", [(224, 256), (224, 248), (384, 425), (384, 438), (32, 36)])
def test_pretrained_cfg_crop_gives_back_the_shorter_side(image, resize):
    from vitlab.data.preprocess import Preprocess

    model = tiny_vit(image_size=image)
    model.preprocess = Preprocess(image_size=(image, image), resize=resize, interpolation="bicubic")
    cfg = model.pretrained_cfg
    # timm's eval transform: scale_size = math.floor(img_size / crop_pct)
    assert math.floor(image / cfg["crop_pct"]) == resize
    assert cfg["crop_mode"] == "center" and cfg["interpolation"] == "bicubic"
    model.preprocess = Preprocess(image_size=(image, image), interpolation="area")
    assert model.pretrained_cfg["interpolation"] == "box"  # timm's create_transform has no 'area' (a KeyError)


def _torchvision_style_file(tmp_path):
    path = tmp_path / "resnet.pth"
    torch.save(tiny_resnet().state_dict(), path)
    return path


def test_loaded_weights_carry_their_preprocessing_and_save_writes_it_back(tmp_path):
    # a torchvision-style ResNet file: ImageNet mean/std, 256 -> 224. Before, vitlab.save of the loaded model wrote
    # vitlab's default (mean 0.5, plain resize), so the reloaded folder fed the network other pixels.
    model, meta = load_with_meta(_torchvision_style_file(tmp_path))
    assert meta["preprocess"].mean == IMAGENET_MEAN
    assert model.pretrained_cfg["mean"] == IMAGENET_MEAN and model.pretrained_cfg["crop_pct"] == 224 / 256
    vitlab.save(model, tmp_path / "native")
    again, meta2 = load_with_meta(tmp_path / "native")
    assert meta2["preprocess"] == meta["preprocess"]
    assert torch.equal(again.fc.weight, model.fc.weight)


def test_class_names_follow_the_head_through_load_and_save(tmp_path):
    vitlab.save(tiny_vit(), tmp_path / "a", class_names=["cat", "dog", "fox"])
    model = vitlab.load(tmp_path / "a")
    assert model.class_names == ["cat", "dog", "fox"] and model.pretrained_cfg["label_names"] == ["cat", "dog", "fox"]
    vitlab.save(model, tmp_path / "b")  # before: written without names
    assert load_with_meta(tmp_path / "b")[1]["class_names"] == ["cat", "dog", "fox"]
    model.reset_classifier(5)  # a new head: the old names no longer apply
    assert model.class_names is None
    vitlab.save(model, tmp_path / "c")
    assert load_with_meta(tmp_path / "c")[1]["class_names"] is None
    assert vitlab.load(tmp_path / "a", num_classes=4).class_names is None


def test_set_image_size_moves_the_preprocessing_with_the_model(tmp_path):
    model = vitlab.load(_torchvision_style_file(tmp_path))
    model.set_image_size(448)
    assert model.preprocess.image_size == (448, 448) and model.preprocess.resize == 512
    assert model.pretrained_cfg["input_size"] == (3, 448, 448)
    assert math.floor(448 / model.pretrained_cfg["crop_pct"]) == 512


# ----------------------------------------------------------------------------------- the hybrids' ResNet
def test_a_hybrids_resnet_overrides_merge_into_its_stem():
    # before: resnet={'ws_eps': 1e-8} replaced R50's (3, 4, 9) stem by the default four stages (stride 32, not 16)
    # without a word, and ws_eps= / layers= on a hybrid were unknown fields
    cfg = vitlab.get_config("r50+vit-b/16", resnet={"ws_eps": 1e-8})
    assert cfg.resnet.layers == (3, 4, 9) and cfg.resnet.ws_eps == 1e-8 and cfg.stride == 16
    assert vitlab.get_config("r50+vit-b/16", ws_eps=1e-8).resnet == cfg.resnet
    model = vitlab.create_model("r26+vit-s/32", layers=(1, 1, 1, 1), ws_eps=1e-8, image_size=64, depth=1)
    assert model.config.resnet.layers == (1, 1, 1, 1)
    assert {m.eps for m in model.patch_embed.backbone.modules() if hasattr(m, "standardized_weight")} == {1e-8}


# ---------------------------------------------------------------------- state dicts shared with timm's ViT
# timm's vit_base_patch16_224(img_size=32, depth=1, embed_dim=64, num_heads=2, num_classes=5, global_pool='avg',
# class_token=False, fc_norm=False) has exactly these keys and shapes, and with the weights below (loaded strictly)
# gave these logits. vitlab's 'gap' (the mean of the tokens after the final LayerNorm) is that model; timm's default
# for 'avg' (fc_norm=True: the LayerNorm after the mean) is not.
TIMM_GAP_LOGITS = [[0.4339773654937744, -0.3121883273124695, -0.08795840293169022, -0.14384235441684723,
                    -0.1047758013010025],
                   [0.3215101659297943, -0.5771905183792114, 0.7493646740913391, 0.49980077147483826,
                    0.021958239376544952]]


def _weights(state_dict):
    g = torch.Generator().manual_seed(18)
    norm = (".norm1.weight", ".norm2.weight")
    return {k: torch.randn(v.shape, generator=g) * 0.1 + (1.0 if k == "norm.weight" or k.endswith(norm) else 0.0)
            for k, v in sorted(state_dict.items())}


def test_a_gap_vit_state_dict_is_timms_avg_pool_model():
    model = vitlab.create_model("vit-b/16-gap", num_classes=5, image_size=32, depth=1, dim=64, heads=2, mlp_dim=256,
                                gelu="exact").eval()  # timm's GELU is the exact one
    assert "cls_token" not in model.state_dict() and model.state_dict()["pos_embed"].shape == (1, 4, 64)
    model.load_state_dict(_weights(model.state_dict()), strict=True)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.allclose(model(x), torch.tensor(TIMM_GAP_LOGITS), atol=1e-5)


# ------------------------------------------------------------------------------------ the peers' keywords
# Hugging Face's ViTConfig says hidden_size, num_hidden_layers, num_attention_heads (num_layers is torchvision's
# VisionTransformer, with num_heads and hidden_dim); these were unknown fields without a hint.
def test_hugging_face_and_torchvision_size_keywords_are_taken():
    hf = vitlab.get_config("custom", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, mlp_dim=128)
    tv = vitlab.get_config("custom", hidden_dim=64, num_layers=2, num_heads=4, mlp_dim=128)
    assert (hf.dim, hf.depth, hf.heads) == (tv.dim, tv.depth, tv.heads) == (64, 2, 4)
    with pytest.raises(VitlabError, match="num_hidden_layers and depth name the same setting"):
        vitlab.get_config("custom", num_hidden_layers=2, depth=3)


@pytest.mark.parametrize("kw, hint", [({"num_labels": 3}, "for num_labels use num_classes"),
                                      ({"hidden_act": "gelu"}, "for hidden_act use gelu"),
                                      ({"act_layer": "gelu"}, "for act_layer use gelu"),
                                      ({"dynamic_img_size": True}, "any multiple of its stride"),
                                      ({"checkpoint_path": "x.pth"}, "pretrained='PATH'"),
                                      ({"init_values": 1e-5}, "no LayerScale"),
                                      ({"exportable": True}, "vitlab export")])
def test_peer_options_without_a_vitlab_setting_say_what_to_do(kw, hint):
    with pytest.raises(VitlabError, match=f"unknown model config fields.*{hint}"):
        vitlab.create_model("vit-ti/16", depth=1, **kw)


def test_features_only_in_a_config_points_to_create_model():
    with pytest.raises(VitlabError, match="unknown model config fields.*create_model.*features_only=True"):
        vitlab.get_config("vit-ti/16", features_only=True)


# ------------------------------------------------------------------------------- a head put in by hand
# The fine-tuning idiom of timm and torchvision users: assign the classifier. timm's own `num_classes` attribute
# stays stale then; vitlab's config did too, and vitlab.save wrote config.json with the old class count beside the
# new head, a folder vitlab.load refused ("shape mismatch head.weight").
@pytest.mark.parametrize("name, attr, width", [("vit-ti/16", "head", 64), ("resnet-18", "fc", 64),
                                               ("bit-r26x1", "head", 256)])
def test_a_head_assigned_by_hand_sets_num_classes(tmp_path, name, attr, width):
    model = tiny_vit(name=name) if name.startswith("vit") else tiny_resnet(name)
    assert model.num_features == width
    setattr(model, attr, torch.nn.Linear(width, 10))
    assert model.num_classes == 10 and model.config.num_classes == 10 and model.pretrained_cfg["num_classes"] == 10
    vitlab.save(model, tmp_path / "m")
    again = vitlab.load(tmp_path / "m")
    assert again.num_classes == 10 and torch.equal(getattr(again, attr).weight, getattr(model, attr).weight)
    setattr(model, attr, torch.nn.Identity())
    assert model.num_classes == 0


# ------------------------------------------------------------------------------------------ group_matcher
# timm's layer-wise LR decay (create_optimizer_v2(model, layer_decay=0.75)) reads model.group_matcher(). Without it
# timm grouped vitlab's ViT by top-level modules: 8 groups, the head at 0.75 of the LR instead of 1.0. With these
# matchers (timm's own regexes for VisionTransformer, ResNet and ResNetV2) every parameter of vitlab's vit-ti/16
# (depth 3), resnet-50 and bit-r50x1 got the same (lr_scale, weight_decay) as in timm's vit_tiny_patch16_224,
# resnet50 and resnetv2_50x1_bit (timm 1.0.31).
TIMM_MATCHERS = {
    "vit": {"stem": r"^cls_token|pos_embed|patch_embed", "blocks": [(r"^blocks\.(\d+)", None), (r"^norm", (99999,))]},
    "standard": {"stem": r"^conv1|bn1|maxpool", "blocks": r"^layer(\d+)\.(\d+)"},
    "bit": {"stem": r"^stem", "blocks": [(r"^stages\.(\d+)\.blocks\.(\d+)", None), (r"^norm", (99999,))]},
}


def test_group_matcher_is_timms_for_the_same_key_names():
    import re

    vit, resnet, bit = tiny_vit(depth=3), tiny_resnet("resnet-50"), tiny_resnet("bit-r26x1")
    assert vit.group_matcher() == TIMM_MATCHERS["vit"]
    assert resnet.group_matcher() == TIMM_MATCHERS["standard"]
    assert resnet.group_matcher(coarse=True)["blocks"] == r"^layer(\d+)"
    assert bit.group_matcher() == TIMM_MATCHERS["bit"]
    assert tiny_resnet("bit-r26x1-postact").group_matcher() == TIMM_MATCHERS["bit"]
    # the patterns reach vitlab's own names: stem, blocks by index, the head in none (timm's last group)
    stem, blocks = TIMM_MATCHERS["vit"]["stem"], TIMM_MATCHERS["vit"]["blocks"][0][0]
    names = [n for n, _ in vit.named_parameters()]
    assert {n for n in names if re.match(stem, n)} == {"cls_token", "pos_embed", "patch_embed.proj.weight",
                                                        "patch_embed.proj.bias"}
    assert {re.match(blocks, n).group(1) for n in names if re.match(blocks, n)} == {"0", "1", "2"}
    assert not any(re.match(p, "head.weight") for p in (stem, blocks, r"^norm"))


# --------------------------------------------------------------------------------- set_grad_checkpointing
# timm's ResNet and ResNetV2 have set_grad_checkpointing(); vitlab's ResNets had none (AttributeError).
@pytest.mark.parametrize("name", ["bit-r26x1", "bit-r26x1-postact"])
def test_groupnorm_resnets_checkpoint_with_the_same_gradients(name):
    model = tiny_resnet(name).train()
    torch.nn.init.normal_(model.head.weight)  # the zero head would give zero gradients below it
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    model(x).square().sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing()
    model(x).square().sum().backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, plain[n]), n  # bit for bit: --grad-checkpointing may change on --resume


def test_a_batchnorm_resnet_refuses_checkpointing_in_one_line():
    model = tiny_resnet()
    with pytest.raises(VitlabError, match="BatchNorm's running statistics twice"):
        model.set_grad_checkpointing()
    model.set_grad_checkpointing(False)  # turning it off is always fine
