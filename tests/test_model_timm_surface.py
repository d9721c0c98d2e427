"""What a timm user reaches for first: `model.num_classes`, `get_classifier()`, and a typo in a timm name that gets a
suggestion instead of a bare "unknown model" (or a stride complaint about the size the name states)."""

import pytest
import torch.nn as nn

import vitlab
from vitlab.errors import VitlabError


@pytest.mark.parametrize("name", ["vit-ti/16", "r+vit-ti/16", "resnet-18", "bit-r50x1", "bit-r50x1-postact"])
def test_num_classes_and_get_classifier_follow_the_head(name):
    model = vitlab.create_model(name, num_classes=7, image_size=64)
    assert model.num_classes == 7 and isinstance(model.get_classifier(), nn.Linear)
    assert model.get_classifier().out_features == 7
    model.reset_classifier(3)
    assert model.num_classes == 3 and model.get_classifier().out_features == 3


@pytest.mark.parametrize("typo, meant", [("vit_bsae_patch16_224", "vit_base_patch16_224"),
                                         ("vit_base_patch16_2244", "vit_base_patch16_224"),
                                         ("vit_base_r50_s16_38", "vit_base_r50_s16_384")])
def test_a_typo_in_a_timm_name_gets_a_suggestion(typo, meant):
    with pytest.raises(VitlabError, match=f"unknown model '{typo}'.*did you mean '{meant}'"):
        vitlab.get_config(typo)
