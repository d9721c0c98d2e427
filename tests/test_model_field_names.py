"""Other libraries' names for model settings: timm's keyword arguments (img_size, embed_dim, num_heads,
drop_path_rate, attn_drop_rate) and Hugging Face's (hidden_size, num_layers) build the same model as vitlab's
names; two spellings of one setting are refused; names that do not map one to one say what to write instead."""

import pytest
import torch

import vitlab
from vitlab.models.registry import get_config
from vitlab.values import typed_model_args


def test_timms_keywords_build_the_model_vitlabs_names_build():
    timm_style = vitlab.create_model("vit_tiny_patch16_224", img_size=64, drop_path_rate=0.1, attn_drop_rate=0.05,
                                     num_classes=10, seed=0)
    vitlab_style = vitlab.create_model("vit-ti/16", image_size=64, drop_path=0.1, attention_dropout=0.05,
                                       num_classes=10, seed=0)
    assert timm_style.config == vitlab_style.config
    assert timm_style.config.image_size == (64, 64)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(timm_style.eval()(x), vitlab_style.eval()(x))
    # timm's drop_path_rate rises linearly from 0 in the first block to the rate in the last, as vitlab's does
    rates = [float(getattr(b.drop_path1, "p", 0.0)) for b in timm_style.blocks]
    assert rates[0] == 0.0 and rates[-1] == pytest.approx(0.1) and rates == sorted(rates)


def test_a_custom_model_in_timms_words():
    config = get_config("custom", embed_dim=64, num_heads=4, depth=2, mlp_dim=128, patch_size=4, img_size=28)
    assert (config.dim, config.heads, config.image_size) == (64, 4, (28, 28))


@pytest.mark.parametrize("kwargs, said", [
    (dict(img_size=64, image_size=32), "image_size and img_size name the same setting"),
    (dict(embed_dim=64, dim=32), "embed_dim and dim name the same setting (dim)"),
    (dict(hidden_size=64, embed_dim=32), "hidden_size and embed_dim name the same setting (dim)"),
])
def test_two_spellings_of_one_setting_are_refused(kwargs, said):
    with pytest.raises(vitlab.VitlabError, match=said.replace("(", r"\(").replace(")", r"\)")):
        vitlab.create_model("custom", **kwargs)


@pytest.mark.parametrize("field, hint", [
    ("mlp_ratio", "for mlp_ratio use mlp_dim (the MLP's width itself: mlp_ratio x dim)"),
    ("drop_rate", "for drop_rate use dropout"),
    ("global_pool", "for global_pool use classifier ('token' or 'gap')"),
    ("dpeth", "for dpeth use depth"),
])
def test_a_name_that_does_not_map_says_what_to_write(field, hint):
    with pytest.raises(vitlab.VitlabError) as exc:
        vitlab.create_model("vit-ti/16", **{field: 2})
    assert hint in str(exc.value) and "known fields" in str(exc.value)


def test_an_unknown_name_without_a_near_one_gets_no_hint():
    with pytest.raises(vitlab.VitlabError) as exc:
        vitlab.create_model("vit-ti/16", zzz=1)
    assert str(exc.value).startswith("unknown model config fields ['zzz']; known fields:")


def test_model_args_from_the_command_line_take_vitlabs_names_and_types():
    """`--model-args embed_dim=32` merges with a preset's dim (not beside it) and is typed as dim is."""
    assert typed_model_args({"embed_dim": "32", "num_heads": "4", "drop_path_rate": "0.1"}) == \
        {"dim": 32, "heads": 4, "drop_path": 0.1}


def test_loading_weights_names_timms_spelling_too(tmp_path):
    from vitlab.weights import save_native

    save_native(vitlab.create_model("custom", dim=32, depth=1, heads=4, mlp_dim=64, patch_size=4, image_size=16,
                                    num_classes=3), tmp_path / "w")
    with pytest.raises(vitlab.VitlabError, match="for mlp_ratio use mlp_dim"):
        vitlab.load(tmp_path / "w", mlp_ratio=4)


def test_load_takes_img_size_as_the_size_to_run_at(tmp_path):
    """As timm's create_model(..., pretrained=True, img_size=384): the position embeddings are resampled."""
    from vitlab.weights import save_native

    save_native(vitlab.create_model("custom", dim=32, depth=1, heads=4, mlp_dim=64, patch_size=4, image_size=16,
                                    num_classes=3, seed=0), tmp_path / "w")
    timm_style, vitlab_style = vitlab.load(tmp_path / "w", img_size=32), vitlab.load(tmp_path / "w", image_size=32)
    assert timm_style.config.image_size == (32, 32)
    assert all(torch.equal(a, b) for a, b in zip(timm_style.state_dict().values(), vitlab_style.state_dict().values()))
    with pytest.raises(vitlab.VitlabError, match="image_size and img_size name the same setting"):
        vitlab.load(tmp_path / "w", img_size=32, image_size=32)


def test_loading_a_resnet_still_takes_resnet_fields(tmp_path):
    """The ResNet readers take ResNet fields (stem, width_factor, ws_eps ...) as overrides; only names no config
    has are refused before reading."""
    torch.save(vitlab.create_model("resnet-18", num_classes=5, seed=0).state_dict(), tmp_path / "r18.pth")
    assert vitlab.load(tmp_path / "r18.pth", stem="bit", base_width=64).config.resnet.stem == "bit"
    with pytest.raises(vitlab.VitlabError, match=r"unknown model config fields \['stemm'\]"):
        vitlab.load(tmp_path / "r18.pth", stemm="small")
