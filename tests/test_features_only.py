"""timm's `features_only` on vitlab models: `create_model(..., features_only=True)` and `vitlab.load(...,
features_only=True)` give a feature extractor built on `forward_intermediates`.

Checked against timm 1.0.31 (torch 2.14.1; tests/fixtures/intermediates19/check_features_only.py, run where timm is
installed), with the same weights loaded strictly: ViT-Ti/16
(exact GELU) with the default, (1, -1) and norm=True within 3.4e-6; ResNet-50 with the default and (2, 3) equal;
feature_info channels and reductions equal. Here the outputs are compared with the whole model's own
`forward_intermediates`, which tests/test_audit19_models.py checks against timm's outputs.
"""

from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.errors import VitlabError
from vitlab.models.features import FeatureExtractor

X = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
VIT = dict(depth=5, dim=32, heads=2, mlp_dim=64, image_size=64, num_classes=3)


def vit(**kw):
    return vitlab.create_model("vit-ti/16", seed=0, **{**VIT, **kw}).eval()


def test_a_vit_gives_its_last_three_blocks_as_timm_does():
    extractor = vitlab.create_model("vit-ti/16", seed=0, features_only=True, **VIT).eval()
    with torch.no_grad():
        features = extractor(X)
        expected = vit().forward_intermediates(X, indices=3, intermediates_only=True)
    assert [tuple(f.shape) for f in features] == [(2, 32, 4, 4)] * 3
    assert all(torch.equal(a, b) for a, b in zip(features, expected))
    assert extractor.out_indices == [2, 3, 4]
    assert extractor.feature_info.channels() == [32, 32, 32] and extractor.feature_info.reduction() == [16] * 3
    assert extractor.feature_info.module_name() == ["blocks.2", "blocks.3", "blocks.4"]
    assert len(extractor.model.blocks) == 5 and isinstance(extractor.model.head, torch.nn.Identity)


def test_chosen_blocks_are_kept_and_the_rest_cut():
    extractor = vitlab.create_model("vit-ti/16", seed=0, features_only=True, out_indices=(0, -4), **VIT).eval()
    assert extractor.out_indices == [0, 1] and len(extractor.model.blocks) == 2
    with torch.no_grad():
        expected = vit().forward_intermediates(X, indices=[0, 1], intermediates_only=True)
        assert all(torch.equal(a, b) for a, b in zip(extractor(X), expected))


def test_tokens_and_the_final_norm_through_feature_cfg():
    extractor = vitlab.create_model("vit-ti/16", seed=0, features_only=True, out_indices=[1],
                                    feature_cfg={"output_fmt": "NLC", "norm": True}, **VIT).eval()
    with torch.no_grad():
        (tokens,) = extractor(X)
        expected = vit().forward_intermediates(X, indices=[1], output_fmt="NLC", norm=True, intermediates_only=True)
    assert tokens.shape == (2, 16, 32) and torch.equal(tokens, expected[0])
    assert isinstance(extractor.model.norm, torch.nn.LayerNorm)  # norm=True keeps it; timm prunes it otherwise


def test_a_resnet_gives_its_stem_and_stages_with_timms_channels_and_strides():
    extractor = vitlab.create_model("resnet-50", seed=0, features_only=True).eval()
    # timm's resnet50 features_only: the same five, at 64/256/512/1024/2048 channels and strides 2..32
    assert extractor.feature_info.channels() == [64, 256, 512, 1024, 2048]
    assert extractor.feature_info.reduction() == [2, 4, 8, 16, 32]
    with torch.no_grad():
        shapes = [tuple(f.shape[1:]) for f in extractor(X)]
    assert shapes == [(64, 32, 32), (256, 16, 16), (512, 8, 8), (1024, 4, 4), (2048, 2, 2)]


def test_a_bit_resnet_cut_after_its_second_stage():
    full = vitlab.create_model("bit-r50x1", seed=0, num_classes=3).eval()
    extractor = vitlab.create_model("bit-r50x1", seed=0, num_classes=3, features_only=True, out_indices=[1, 2]).eval()
    with torch.no_grad():
        expected = full.forward_intermediates(X, indices=[1, 2], intermediates_only=True)
        assert all(torch.equal(a, b) for a, b in zip(extractor(X), expected))
    assert len(extractor.model.stages) == 2 and extractor.feature_info.channels() == [256, 512]


def test_load_gives_an_extractor_in_eval_mode(tmp_path):
    vitlab.save(vit(), tmp_path / "m")
    extractor = vitlab.load(tmp_path / "m", features_only=True, out_indices=2)
    assert isinstance(extractor, FeatureExtractor) and not extractor.training and extractor.out_indices == [3, 4]


def test_state_dict_keys_sit_under_model_as_in_timms_feature_getter():
    extractor = vitlab.create_model("vit-ti/16", seed=0, features_only=True, **VIT)
    assert "model.blocks.0.attn.qkv.weight" in extractor.state_dict()
    assert not any(k.startswith("model.head") or k.startswith("model.norm") for k in extractor.state_dict())


@pytest.mark.parametrize("name, kw, message", [
    ("vit-ti/16", dict(features_only=True, out_indices=[9]), "out of range"),
    ("resnet-18", dict(features_only=True, feature_cfg={"output_fmt": "NLC"}), "output_fmt='NLC'"),
    ("resnet-18", dict(features_only=True, feature_cfg={"flatten_sequential": True}), "feature_cfg"),
    ("resnet-18", dict(out_indices=[1]), "features_only=True"),
])
def test_wrong_feature_options_are_one_line(name, kw, message):
    with pytest.raises(VitlabError, match=message) as info:
        vitlab.create_model(name, seed=0, **{**(VIT if name.startswith("vit") else {}), **kw})
    assert "\n" not in str(info.value)


def test_save_refuses_an_extractor_and_says_how_to_get_it_back(tmp_path):
    extractor = vitlab.create_model("vit-ti/16", seed=0, features_only=True, **VIT)
    with pytest.raises(VitlabError, match=r"save the whole model.*vitlab.load\(FOLDER, features_only=True"):
        vitlab.save(extractor, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_a_vit_pruned_with_its_norm_still_takes_a_new_head():
    """prune_intermediate_layers(prune_norm=True) dropped the norm before resetting the head, whose reset read the
    norm's weight for its dtype: AttributeError on 'Identity'."""
    model = vit()
    assert model.prune_intermediate_layers([1], prune_norm=True) == [1]
    model.reset_classifier(4)
    assert model.head.out_features == 4 and model.head.weight.dtype == torch.float32
