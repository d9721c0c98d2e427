"""The peers' names for the paper's models (vitlab.weights.peer_names): timm's architecture and checkpoint names and
Hugging Face repo ids mean the same model or checkpoint as vitlab's names, and what vitlab does not build or list
fails in one line that says what to do instead."""

import pytest

import vitlab
from test_download import _tiny_npz, server  # noqa: F401  (server: the local HTTP server fixture)
from vitlab.errors import VitlabError
from vitlab.models.registry import get_config
from vitlab.weights import hub, pretrained


@pytest.mark.parametrize("timm_name, ours, size", [
    ("vit_tiny_patch16_224", "vit-ti/16", 224), ("vit_small_patch32_384", "vit-s/32", 384),
    ("vit_base_patch16_384", "vit-b/16", 384), ("vit_base_patch8_224", "vit-b/8", 224),
    ("vit_large_patch16_224", "vit-l/16", 224), ("vit_huge_patch14_224", "vit-h/14", 224),
    ("vit_base_r50_s16_384", "r50+vit-b/16", 384), ("vit_small_r26_s32_224", "r26+vit-s/32", 224),
    ("vit_base_r26_s32_224", "r26+vit-b/32", 224), ("vit_large_r50_s32_384", "r50+vit-l/32", 384),
    ("vit_tiny_r_s16_p8_224", "r+vit-ti/16", 224), ("VIT_BASE_PATCH16_224", "vit-b/16", 224),
])
def test_timm_architecture_names_are_the_same_configs(timm_name, ours, size):
    assert get_config(timm_name) == get_config(ours, image_size=size)
    assert get_config(timm_name, image_size=448) == get_config(ours, image_size=448)  # a size given wins


def test_a_timm_name_builds_the_model_at_its_size_with_the_official_numerics():
    model = vitlab.create_model("vit_tiny_patch16_384", num_classes=5)
    assert model.config.name == "vit-ti/16" and model.config.image_size == (384, 384)
    assert model.config.gelu == "tanh" and model.pos_embed.shape[1] == 1 + 24 * 24
    assert vitlab.create_model("vit_tiny_patch16_384", image_size=224).config.image_size == (224, 224)


@pytest.mark.parametrize("name", ["vit_base_patch16_clip_224", "vit_base_patch16_224_in21k", "vit_base_patch15_224",
                                  "vit_giant_patch14_224", "vit_base_r50_s16", "deit_base_patch16_224"])
def test_peer_architectures_vitlab_does_not_build_are_unknown(name):
    with pytest.raises(VitlabError, match="unknown model"):
        get_config(name)


@pytest.mark.parametrize("name, ours", [
    ("vit_base_patch16_224.augreg_in21k_ft_in1k", "vit-b/16.augreg-in21k-ft-in1k-224"),
    ("vit_base_patch16_384.augreg_in21k_ft_in1k", "vit-b/16.augreg-in21k-ft-in1k-384"),
    ("vit_small_patch16_224.augreg_in1k", "vit-s/16.augreg-in1k-224"),
    ("vit_tiny_patch16_224.augreg_in21k", "vit-ti/16.augreg-in21k"),
    ("vit_base_patch16_384.orig_in21k_ft_in1k", "vit-b/16.orig-in21k-ft-in1k-384"),
    ("vit_large_patch32_224.orig_in21k", "vit-l/32.orig-in21k"),
    ("vit_base_r50_s16_384.orig_in21k_ft_in1k", "r50+vit-b/16.orig-in21k-ft-in1k-384"),
    ("google/vit-base-patch16-224", "vit-b/16.hf-in21k-ft-in1k-224"),
    ("Google/ViT-Huge-Patch14-224-In21k", "vit-h/14.hf-in21k"),
])
def test_peer_checkpoint_names_find_the_same_checkpoint(name, ours):
    assert pretrained.lookup(name) is pretrained.PRETRAINED[ours]


@pytest.mark.parametrize("name", [
    "vit_base_patch16_384.augreg_in21k",  # pre-training checkpoints are at 224 only
    "vit_base_patch16_224.augreg2_in21k_ft_in1k",  # timm's own fine-tune, not a published ViT file
    "facebook/deit-base-patch16-224", "google/vit-base-patch16-999", "runs/model", "vit-b/16", "r50+vit-b/16",
])
def test_other_names_are_no_checkpoint(name):
    assert pretrained.lookup(name) is None


def test_create_model_takes_a_checkpoint_as_the_model_only_with_pretrained():
    for name in ("vit_tiny_patch16_224.augreg_in21k", "google/vit-base-patch16-224", "vit-b/16.augreg-in21k"):
        with pytest.raises(VitlabError, match="names a checkpoint .*pass pretrained=True"):
            vitlab.create_model(name)
    with pytest.raises(VitlabError, match="names a checkpoint .*not a model"):
        get_config("vit_base_patch16_224.augreg_in21k_ft_in1k")
    with pytest.raises(VitlabError, match=r"not a checkpoint vitlab lists .*vitlab.load\('hf:timm/"):
        vitlab.create_model("vit_base_patch16_224.augreg2_in21k_ft_in1k", pretrained=True)
    with pytest.raises(VitlabError, match="no published checkpoint of 'vit-ti/16' at 512 px"):
        vitlab.create_model("vit_tiny_patch16_512", pretrained=True)


def test_timm_names_download_the_published_file(server, tmp_path, monkeypatch):  # noqa: F811 (the fixture)
    monkeypatch.setenv("VITLAB_WEIGHTS_URL", server.url)
    entry = pretrained.PRETRAINED["vit-ti/16.augreg-in21k-ft-in1k-384"]
    data = _tiny_npz(tmp_path / "ti.npz", dim=192, depth=12, heads=3, mlp=768, patch=16, grid=24, classes=7)
    server.files[f"/{entry.path}"] = data.read_bytes()
    ours = vitlab.load(entry.name)
    for name in ("vit_tiny_patch16_384.augreg_in21k_ft_in1k", "vit_tiny_patch16_384"):
        model = vitlab.create_model(name, pretrained=True)  # the untagged name: its first checkpoint at 384
        assert model.config.image_size == (384, 384) and model.config.num_classes == 7
        assert all(a.equal(b) for a, b in zip(model.state_dict().values(), ours.state_dict().values()))
    assert [path for path, _ in server.log] == [f"/{entry.path}"]  # downloaded once, then cached


def test_a_hugging_face_repo_id_loads_without_the_hf_prefix(monkeypatch, tmp_path):
    from test_engine import tiny

    folder = vitlab.weights.save_hf(tiny(), tmp_path / "hf")
    asked = []
    monkeypatch.setattr(hub, "fetch_hf", lambda repo: asked.append(repo) or folder)
    model = vitlab.load("google/vit-base-patch16-224")
    assert asked == ["google/vit-base-patch16-224"] and model.config.dim == tiny().config.dim
    with pytest.raises(VitlabError, match="no such file or folder: facebook/deit-base-patch16-224 .*if you meant "
                       "the Hugging Face Hub repo, write hf:facebook/deit-base-patch16-224"):
        vitlab.load("facebook/deit-base-patch16-224")  # a repo vitlab does not list: a missing path, with a hint
    assert asked == ["google/vit-base-patch16-224"]


def test_a_timm_model_name_where_weights_are_needed_offers_a_checkpoint_at_its_size():
    from vitlab.weights import resolve_weights

    with pytest.raises(VitlabError, match="such as vit-b/16.augreg-in21k-ft-in1k-384 "):
        resolve_weights("vit_base_patch16_384")
    with pytest.raises(VitlabError, match="such as vit-ti/16.augreg-in21k-ft-in1k-224 "):
        resolve_weights("vit_tiny_patch16_224")
