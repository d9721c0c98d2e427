"""Models audit: timm's `forward_intermediates` / `prune_intermediate_layers` / `feature_info` on vitlab's ViT,
hybrids and the three ResNet families, and timm post-activation ResNetV2 files that say too little to be read.

The timm comparison runs against tests/fixtures/intermediates19 (timm's outputs on seeded float64 weights, made with
the peers by its make_fixture.py); the rest checks vitlab against its own forward, where equality is exact.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import vitlab
from vitlab.errors import VitlabError
from vitlab.weights import save_timm
from vitlab.weights.timm import to_timm_state_dict

FIXTURE = Path(__file__).parent / "fixtures" / "intermediates19"
_spec = importlib.util.spec_from_file_location("intermediates19_cases", FIXTURE / "cases.py")
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

# |vitlab - timm| allowed per case (float64). The post-activation units standardise as the official code,
# (w - mean) / (std + eps), timm as sqrt(var + eps): 7.9e-6 in the hybrid, 9.5e-5 in the R26 here (README).
TOLERANCE = {"vit_ti16": 1e-9, "resnet50": 1e-9, "bit_r50x1": 1e-9, "hybrid_r2": 1e-5, "bit_post_r26": 2e-4}


@pytest.fixture(scope="module")
def expected() -> dict:
    return json.loads((FIXTURE / "expected.json").read_text())


@pytest.mark.parametrize("case", cases.CASES)
def test_every_intermediate_matches_timms(case, expected):
    """Each call's final features and intermediates against timm's (same weights, strict load): shapes, means and
    24 values per tensor. Before, vitlab's models had no forward_intermediates (AttributeError)."""
    model = cases.build(case)
    tol = TOLERANCE[case]
    for record in expected[case]:
        got = cases.outputs(model, record["call"])
        assert len(got) == len(record["outputs"]), record["call"]
        for ours, theirs in zip(got, record["outputs"], strict=True):
            mine = cases.summary(ours)
            assert mine["shape"] == theirs["shape"], record["call"]
            assert abs(mine["mean"] - theirs["mean"]) <= tol
            assert max(abs(a - b) for a, b in zip(mine["values"], theirs["values"], strict=True)) <= tol, record["call"]


def _tiny(name: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    small = dict(image_size=32, num_classes=3)
    if name.startswith(("vit", "r+vit")):
        small.update(depth=4)
    else:
        small.update(layers=(1, 1, 1), base_width=32)
    model = vitlab.create_model(name, **{**small, **kw}).eval()
    with torch.no_grad():  # zero-initialised heads and norm scales would hide a wrong answer
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


MODELS = ["vit-ti/16", "r+vit-ti/16", "resnet-50", "bit-r50x1", "bit-r50x1-postact"]


@pytest.mark.parametrize("name", MODELS)
def test_final_output_is_forward_features_and_the_last_normed_intermediate_is_too(name):
    model = _tiny(name)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        final, maps = model.forward_intermediates(x, norm=True)
        features = model.forward_features(x)
    assert torch.equal(final, features)
    last = maps[-1]
    if features.dim() == 3:  # tokens: the map is the patch tokens laid out on the grid
        last = last.flatten(2).transpose(1, 2)
        features = features[:, model.num_prefix_tokens:]
    assert torch.equal(last, features)
    info = model.feature_info
    assert len(info) == len(maps)
    for entry, m in zip(info, maps, strict=True):
        assert m.shape[1] == entry["num_chs"] and 32 // m.shape[-1] == entry["reduction"]


@pytest.mark.parametrize("name", MODELS)
def test_indices_last_n_negative_and_stop_early_select_the_same_maps(name):
    model = _tiny(name)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        every = model.forward_intermediates(x, intermediates_only=True)
        n = len(every)
        last_two = model.forward_intermediates(x, indices=2, intermediates_only=True)
        chosen = model.forward_intermediates(x, indices=[0, -2], intermediates_only=True, stop_early=True)
    assert all(torch.equal(a, b) for a, b in zip(last_two, every[-2:], strict=True))
    assert torch.equal(chosen[0], every[0]) and torch.equal(chosen[1], every[n - 2])
    for bad in (n + 1, [n], [-n - 1], 0):
        with pytest.raises(VitlabError, match="indices|index") as info:
            model.forward_intermediates(x, indices=bad)
        assert "\n" not in str(info.value)


def test_vit_tokens_prefix_and_dict_outputs():
    model = _tiny("vit-ti/16")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        final, pairs = model.forward_intermediates(x, indices=[1], output_fmt="NLC", return_prefix_tokens=True)
        tokens = model.blocks[1](model.blocks[0](model.embed(x))[0])[0]
        out = model.forward_intermediates(x, indices=1, output_dict=True, return_prefix_tokens=True)
    (patches, prefix), = pairs
    assert torch.equal(prefix, tokens[:, :1]) and torch.equal(patches, tokens[:, 1:])
    assert set(out) == {"image_intermediates", "image_intermediates_prefix", "image_features"}
    assert torch.equal(out["image_features"], final)
    with pytest.raises(VitlabError, match="output_fmt"):
        _tiny("resnet-50").forward_intermediates(x, output_fmt="NLC")


def test_vit_prune_keeps_what_the_indices_need_and_saves_as_a_shallower_model(tmp_path):
    model = _tiny("vit-ti/16")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
    assert model.prune_intermediate_layers([0, 1]) == [0, 1]
    assert len(model.blocks) == 2 and model.config.depth == 2 and model.num_classes == 0
    with torch.no_grad():
        after = model.forward_intermediates(x, intermediates_only=True)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        vitlab.save(model, tmp_path / "pruned")
        back = vitlab.load(tmp_path / "pruned").eval()
        assert torch.equal(back.forward_features(x), model.forward_features(x))


@pytest.mark.parametrize("index", [2, 0], ids=["middle-stage", "stem"])
@pytest.mark.parametrize("name", ["resnet-50", "bit-r50x1", "bit-r50x1-postact"])
def test_resnet_pruned_to_a_feature_makes_its_map_the_features(name, index):
    """timm: the pre-head norm goes with the last stage, and the stem's pool when only the stem is kept."""
    model = _tiny(name)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        kept = model.forward_intermediates(x, indices=[index], intermediates_only=True)[0]
    assert model.prune_intermediate_layers([index]) == [index]
    assert model.num_classes == 0 and model.config.resnet.layers == (1,) * index
    assert model.num_features == kept.shape[1]
    with torch.no_grad():
        assert torch.equal(model.forward_features(x), kept)
        assert model(x).shape == (2, kept.shape[1])


# --------------------------------------------------------------------------- timm post-activation ResNetV2 files
def _post_activation(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return vitlab.create_model("bit-r26x1-postact", num_classes=3, image_size=32, layers=(1, 1)).eval()


def test_a_foreign_timm_post_activation_resnetv2_file_is_refused_in_one_line(tmp_path):
    """timm's ResNetV2(preact=False) keys do not say its stem_type or StdConv eps; vitlab read every such file as
    the ViT code's units ('SAME' padding, official eps), 2e-6 to 5e-3 away from what timm computed (measured with
    timm 1.0.31 on stem_type '', 'fixed' and 'same'). Before, it loaded."""
    sd = to_timm_state_dict(_post_activation())  # the same keys and shapes as timm's, no vitlab record
    torch.save(sd, tmp_path / "resnetv2_post.pth")
    with pytest.raises(VitlabError, match="stem_type") as info:
        vitlab.load(tmp_path / "resnetv2_post.pth")
    assert "\n" not in str(info.value) and "hybrid" in str(info.value)
    with pytest.raises(VitlabError, match="stem_type"):  # the eps alone does not settle the padding
        vitlab.load(tmp_path / "resnetv2_post.pth", ws_eps=1e-8)


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_vitlabs_own_post_activation_export_still_loads(tmp_path, suffix):
    model = _post_activation()
    back = vitlab.load(save_timm(model, tmp_path / f"r{suffix}")).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))


def test_a_timm_hybrid_file_still_loads_as_a_hybrid(tmp_path):
    """The same post-activation units under `patch_embed.backbone.` are a hybrid's stem, read as before."""
    torch.manual_seed(0)
    hybrid = vitlab.create_model("r+vit-ti/16", num_classes=3, image_size=64, depth=1, layers=(1,)).eval()
    torch.save(to_timm_state_dict(hybrid), tmp_path / "hybrid.pth")
    loaded = vitlab.load(tmp_path / "hybrid.pth", classifier="token")
    assert type(loaded).__name__ == "VisionTransformer" and loaded.config.resnet.layers == (1,)
    assert loaded.config.resnet.ws_eps == 1e-8  # a foreign hybrid file: timm's eps, as before
