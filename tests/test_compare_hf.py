"""`vitlab compare` end to end over real Hugging Face folders (written by `save_pretrained`) with the seed
settings scaled down: lr 1e-5, batch 16, a fraction of an epoch, an ImageNet-1k head through a class-map file."""

import csv
import json

import pytest

from vitlab.cli import main
from vitlab.experiments.compare import _safe

transformers = pytest.importorskip("transformers")

FOOT = "Sandal,Sneaker,Ankle boot"
# the five ImageNet-1k footwear labels as Hugging Face configs spell them; the rest are placeholders
IN1K = {i: f"imagenet class {i}" for i in range(1000)}
IN1K.update({502: "clog, geta, patten, sabot", 514: "cowboy boot", 630: "Loafer", 770: "running shoe", 774: "sandal"})


def _hf_vit(folder):
    import torch

    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=28, patch_size=7, num_channels=1, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32, id2label=IN1K,
                                 label2id={v: k for k, v in IN1K.items()})
    transformers.ViTForImageClassification(cfg).save_pretrained(folder)
    return folder


def _hf_resnet(folder):
    import torch

    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                    layer_type="basic", id2label=IN1K, label2id={v: k for k, v in IN1K.items()})
    transformers.ResNetForImageClassification(cfg).save_pretrained(folder)
    return folder


def test_compare_hf_vit_and_resnet_folders_end_to_end(tmp_path, capsys):
    families = ["vit", "resnet"]
    folders = {"vit": _hf_vit(tmp_path / "hf-vit"), "resnet": _hf_resnet(tmp_path / "hf-resnet")}
    names = {"vit": "hf-vit-in1k", "resnet": "hf-resnet-in1k"}
    models = [names[f] for f in families]
    # the map as a file, by ImageNet label names (the folders store their id2label)
    cmap = tmp_path / "footwear.txt"
    cmap.write_text("# Fashion-MNIST footwear -> ImageNet-1k\nSandal = sandal\nSneaker = running shoe + Loafer\n"
                    "Ankle boot = cowboy boot\n")
    out = tmp_path / "cmp"
    rc = main(["compare", "--data", "bundled", "--classes", FOOT, "--per-class", "16",
               "--models", ",".join(models), "--weights", ",".join(str(folders[f]) for f in families),
               "--lr", "1e-5", "--batch-size", "16", "--epochs", "0.7", "--zero-shot-map", str(cmap),
               "--precision", "fp32", "--out", str(out), "--quiet"])
    printed = capsys.readouterr().out
    assert rc == 0
    summary = json.loads((out / "compare.json").read_text())
    res = {r["model"]: r for r in summary["models"]}
    with (out / "compare.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["model"] for r in rows] == models  # CSV rows = models
    for row in rows:
        r = res[row["model"]]
        assert row["status"] == "ok" and r["source"] == "pretrained"
        assert row["zero_shot_evaluation"] == r["zero_shot_label"] == "zero-shot (mapped ImageNet head)"
        assert r["zero_shot"]["head"]["n"] == summary["test_images"]
        # one number everywhere: the table, compare.json and the per-model reports
        for kind, col in (("zero-shot", "zero_shot"), ("fine-tuned", "fine_tuned")):
            report = json.loads((out / _safe(row["model"]) / kind / "metrics.json").read_text())
            assert float(row[f"{col}_accuracy"]) == pytest.approx(r[col]["head"]["accuracy"], abs=1e-6)
            assert report["head"]["accuracy"] == r[col]["head"]["accuracy"]
            assert f"{100 * r[col]['head']['accuracy']:.2f}" in printed
        assert r["fine_tuned"]["head"]["accuracy"] == pytest.approx(r["train_test_accuracy"])
        # runtimes: a fraction of an epoch (48 images, batch 16: 3 steps/epoch -> 3 * 0.7 -> 3 steps)
        assert float(row["train_time_s"]) > 0 and float(row["train_images_per_s"]) > 0 and row["epochs"] == "1"
        assert [h["epoch"] for h in r["history"]] == [0, 1]
        assert r["history"][0]["evaluation"] == "zero-shot (mapped ImageNet head)"
    with (out / "history.csv").open() as f:
        hist = list(csv.DictReader(f))
    assert [(h["model"], h["epoch"]) for h in hist] == [(m, e) for m in models for e in ("0", "1")]
    for f in ("val_loss.png", "val_accuracy.png", "runtime.png", "compare.md"):
        assert (out / f).stat().st_size > 0, f
    md = (out / "compare.md").read_text()
    assert f"map: file {cmap}" in md and "zero-shot (mapped ImageNet head)" in md
    assert "zero-shot (mapped ImageNet head)" in printed and "train images/s" in printed


def test_compare_looks_an_hf_name_up_once(tmp_path, monkeypatch, capsys):
    """Each look-up of an `hf:` name asks the Hub whether the snapshot is fresh; the command's pre-flight check,
    run_compare's check (for API callers) and the load must share one answer."""
    from vitlab.weights import hub

    folder = _hf_vit(tmp_path / "hf-vit")
    real, asked = hub.resolve, []

    def fake_resolve(text):
        if str(text).startswith("hf:"):
            asked.append(text)
            return folder
        return real(text)

    monkeypatch.setattr(hub, "resolve", fake_resolve)
    rc = main(["compare", "--data", "bundled", "--classes", FOOT, "--per-class", "8", "--models", "hf:org/tiny-vit",
               "--epochs", "0.5", "--precision", "fp32", "--out", str(tmp_path / "cmp"), "--quiet"])
    assert rc == 0
    assert asked == ["hf:org/tiny-vit"]
    summary = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert summary["models"][0]["source"] == "pretrained"
