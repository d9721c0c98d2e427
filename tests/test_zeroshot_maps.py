"""Zero-shot class maps: inline, JSON and text files, bundled examples, head label names; one-line errors."""

import json

import pytest
import torch

from vitlab.data import Preprocess, load_data
from vitlab.errors import VitlabError
from vitlab.evaluate import zeroshot as zs
from vitlab.evaluate.runner import evaluate_model
from vitlab.models import create_model

FOOT = ["Sandal", "Sneaker", "Ankle boot"]
WANT = [[774], [770, 630], [514]]


def _in1k_names():
    names = [f"class {i}" for i in range(1000)]
    names[502], names[514], names[630] = "clog, geta, patten, sabot", "cowboy boot", "Loafer"
    names[770], names[774] = "running shoe", "sandal"
    return names


def test_all_forms_give_the_same_map(tmp_path):
    inline = "Sandal=774,Sneaker=770+630,Ankle boot=514"
    (tmp_path / "m.json").write_text(json.dumps({"Sandal": [774], "Sneaker": [770, 630], "Ankle boot": 514}))
    (tmp_path / "m.txt").write_text("# footwear\nSandal = 774\n\nSneaker = 770 + 630  # two classes\nAnkle boot=514\n")
    for spec in (inline, tmp_path / "m.json", tmp_path / "m.txt", "fashion-mnist-footwear-in1k"):
        assert zs.parse_class_map(str(spec), FOOT, 1000) == WANT, spec
    assert zs.read_class_map(str(tmp_path / "m.json"))[1] == f"file {tmp_path / 'm.json'}"
    assert zs.read_class_map(inline)[1] == "inline"
    # the bundled 21k variant for BiT-M heads
    assert zs.parse_class_map("fashion-mnist-footwear-in21k", FOOT, 21843) == [[10040], [9970, 8242], [6005, 4942]]
    assert set(zs.bundled_maps()) >= {"fashion-mnist-footwear-in1k", "fashion-mnist-footwear-in21k"}


def test_head_label_names(tmp_path):
    names = _in1k_names()
    (tmp_path / "n.txt").write_text("Sandal = sandal\nSneaker = running shoe + loafer\nAnkle boot = 514\n")
    assert zs.parse_class_map(str(tmp_path / "n.txt"), FOOT, 1000, names) == WANT
    # one synonym of a multi-name label; JSON lists mixing names and indices
    (tmp_path / "n.json").write_text(json.dumps({"Sandal": ["geta", 774], "Sneaker": [770], "Ankle boot": ["cowboy boot"]}))
    assert zs.parse_class_map(str(tmp_path / "n.json"), FOOT, 1000, names) == [[502, 774], [770], [514]]
    with pytest.raises(VitlabError, match="no class names stored"):
        zs.parse_class_map(str(tmp_path / "n.txt"), FOOT, 1000)
    with pytest.raises(VitlabError, match="neither an index nor a class"):
        zs.parse_class_map("Sandal=sandles,Sneaker=770,Ankle boot=514", FOOT, 1000, names)


def test_bad_maps_are_one_clear_line(tmp_path):
    cases = {
        "nope/missing.json": "not found",
        "Sandal=774": "unmapped",
        "Sandal=774,Sneaker=770,Ankle boot=1000": "outside the pretrained head",
        "Sandal=774,Sneaker=770,Boot=514": "does not have",
        "Sandal,Sneaker=770": "bad entry",
    }
    (tmp_path / "bad.json").write_text("{not json")
    cases[str(tmp_path / "bad.json")] = "not valid JSON"
    (tmp_path / "list.json").write_text("[774, 770]")
    cases[str(tmp_path / "list.json")] = "must be a JSON object"
    for spec, msg in cases.items():
        with pytest.raises(VitlabError, match=msg) as err:
            zs.parse_class_map(spec, FOOT, 1000)
        assert "\n" not in str(err.value)


def test_evaluation_through_a_map_file_is_labelled(tmp_path):
    data = load_data("bundled", classes=",".join(FOOT), per_class=2, progress=False)
    pre = Preprocess.for_model(28, channels=1)
    model = create_model("custom", num_classes=1000, dim=16, depth=1, heads=2, mlp_dim=32, patch_size=7,
                         image_size=28, in_chans=1, seed=0)
    with torch.no_grad():
        model.head.weight.normal_(0, 1.0)
    kw = dict(batch_size=100, progress=False)
    by_file = evaluate_model(model, data, pre, zero_shot_map="fashion-mnist-footwear-in1k", **kw)
    inline = evaluate_model(model, data, pre, zero_shot_map="Sandal=774,Sneaker=770+630,Ankle boot=514", **kw)
    assert by_file.predictions == inline.predictions
    assert by_file.rows[0]["label"] == "zero-shot (mapped ImageNet head)"
    assert "bundled map fashion-mnist-footwear-in1k" in by_file.rows[0]["note"]
    assert by_file.head_metrics["loss"] > 0  # the renormalised mapped probabilities' cross-entropy
    fresh = evaluate_model(model, data, pre, **kw)
    assert fresh.rows[0]["label"] == "zero-shot (fresh head, chance)"
    assert zs.mapped_label(21843) == "zero-shot (mapped ImageNet-21k head)"


# ImageNet-1k's labels as Hugging Face configs spell them have exactly these collisions
HEAD = ["tench, Tinca tinca", "Cardigan, Cardigan Welsh corgi", "crane", "cardigan", "crane", "maillot",
        "maillot, tank suit"]


def test_a_label_name_matches_a_whole_label_first_and_never_guesses():
    names = ["Pullover", "Bird", "Swim"]
    # 'cardigan' is the sweater's whole label (3), not the dog's synonym (1); 'maillot' likewise (5, not 6)
    assert zs.parse_class_map("Pullover=cardigan,Bird=0,Swim=maillot", names, 7, HEAD) == [[3], [0], [5]]
    assert zs.parse_class_map("Pullover=tank suit,Bird=Tinca tinca,Swim=5", names, 7, HEAD) == [[6], [0], [5]]
    # one head class for two data classes would make them tie for ever: refused (the audit's fix)
    with pytest.raises(VitlabError, match="head class 6 for both 'Pullover' and 'Swim'"):
        zs.parse_class_map("Pullover=tank suit,Bird=Tinca tinca,Swim=6", names, 7, HEAD)
    with pytest.raises(VitlabError, match=r"'crane' \(for 'Bird'\) matches 2 classes .* 2 \('crane'\), 4 \('crane'\)"):
        zs.parse_class_map("Pullover=3,Bird=crane,Swim=5", names, 7, HEAD)


@pytest.mark.parametrize("spec, message", [
    ("cat=0,dog=1,cat=2", "maps class 'cat' twice"),
    ("cat=0,dog=1,0=2", "maps class 'cat' twice"),
    ("cat=²,dog=1", "neither an index nor a class"),
    ("cat=0,²=1", "does not have"),
])
def test_repeated_classes_and_odd_digits_are_one_line(spec, message):
    with pytest.raises(VitlabError, match=message):
        zs.parse_class_map(spec, ["cat", "dog"], 7, HEAD)
    if "twice" in message:
        with pytest.raises(VitlabError, match=message):
            zs.check_map_fits_data(spec, ["cat", "dog"])
