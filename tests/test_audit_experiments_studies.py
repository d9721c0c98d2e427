"""Audit of `vitlab study scaling|transfer` (experiments): an interrupted study resumes to the numbers of an
uninterrupted one whatever the model spec holds, and a finished study is found again however --out is spelled."""

import json

from vitlab.cli import main
from vitlab.train.loop import TrainingRun

# a spec with a tuple override: config.yaml records it as a list, and the resume compared (1,) with [1]
RESNET = "resnet-26-small(layers=(1,),base_width=4)"
TINY = "custom(dim=16,depth=1,heads=2,mlp_dim=32,patch_size=7)"


def _kill_after_first_checkpoint(monkeypatch, where: str):
    real = TrainingRun.save_checkpoint

    def save_then_kill(self, *args, **kwargs):
        real(self, *args, **kwargs)
        if where in str(self.run.path):
            monkeypatch.setattr(TrainingRun, "save_checkpoint", real)
            raise KeyboardInterrupt

    monkeypatch.setattr(TrainingRun, "save_checkpoint", save_then_kill)


def _numbers(rows):
    return [{k: v for k, v in r.items() if "time" not in k and k != "reused"} for r in rows]


def _auto_precision_per_model(monkeypatch):
    """What the recipes' `--precision auto` picks on a CPU with fast bf16: bf16 for a ViT (bf16-stem for a
    conv-stem hybrid), fp32 for a ResNet; patched so that the test does not depend on this machine's CPU."""
    import vitlab.train.loop as loop

    real = loop.run_precision

    def per_model(cfg, device, model, info):
        if cfg.precision == "auto":
            return "bf16" if getattr(model.config, "arch", "vit") == "vit" else "fp32"
        return real(cfg, device, model, info)

    monkeypatch.setattr(loop, "run_precision", per_model)


def test_scaling_resumes_a_run_whose_spec_has_a_tuple(tmp_path, monkeypatch, capsys):
    _auto_precision_per_model(monkeypatch)
    args = ["study", "scaling", "--data", "bundled", "--models", f"{TINY},{RESNET}", "--sizes", "20", "--seeds", "1",
            "--min-steps", "3", "--min-epochs", "1", "--batch-size", "10", "--evals", "2", "--threads", "1", "--quiet"]
    _kill_after_first_checkpoint(monkeypatch, "resnet-26-small-layers--1---base_width-4-n20-s0")
    assert main([*args, "--out", str(tmp_path / "cut")]) == 130
    capsys.readouterr()
    rc = main([*args, "--out", str(tmp_path / "cut")])
    assert rc == 0, capsys.readouterr().err  # was: "cannot resume ...: model_args.layers [1] -> (1,)"
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    cut, whole = (json.loads((tmp_path / f / "study.json").read_text()) for f in ("cut", "whole"))
    assert _numbers(cut["rows"]) == _numbers(whole["rows"])
    assert [r["test_accuracy"] for r in cut["runs"]] == [r["test_accuracy"] for r in whole["runs"]]
    # the report said "the same recipe for every model" without the precision `auto` chose per model
    assert [r["precision"] for r in whole["rows"]] == ["bf16", "fp32"]
    md = (tmp_path / "whole" / "study.md").read_text()
    assert "**not the same for every model**" in md and f"{TINY} bf16; {RESNET} fp32." in md


def test_transfer_resumes_a_tuple_spec_and_finds_its_study_under_another_spelling(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _auto_precision_per_model(monkeypatch)
    args = ["study", "transfer", "--data", "bundled", "--upstream", "T-shirt/top,Trouser", "--downstream",
            "Sandal,Sneaker", "--models", f"{TINY},{RESNET}", "--per-class", "5", "--pretrain-epochs", "2",
            "--finetune-epochs", "1", "--finetune-min-steps", "2", "--threads", "1", "--quiet"]
    _kill_after_first_checkpoint(monkeypatch, "pretrain/resnet")
    assert main([*args, "--out", "st"]) == 130
    capsys.readouterr()
    rc = main([*args, "--out", "st"])
    assert rc == 0, capsys.readouterr().err  # was: "cannot resume ...: model_args.layers [1] -> (1,)"
    before = json.loads((tmp_path / "st" / "study.json").read_text())["rows"]
    # the report called both recipes identical for every model without the precision `auto` chose per model
    assert [(r["pretrain_precision"], r["finetune_precision"]) for r in before] == [("bf16", "bf16"), ("fp32", "fp32")]
    md = (tmp_path / "st" / "study.md").read_text()
    assert f"Pre-training precision **not the same for every model** (`auto` chose it per model): {TINY} bf16; " \
           f"{RESNET} fp32. Fine-tuning precision **not the same" in md

    # the same study by its absolute path (or ./st): everything is reused, nothing is fine-tuned again
    import vitlab.experiments.compare as cmp

    def no_finetune(*a, **k):
        raise AssertionError("a finished model was fine-tuned again")

    monkeypatch.setattr(cmp, "_finetune", no_finetune)
    for out in (str(tmp_path / "st"), "./st"):
        rc = main([*args, "--out", out])
        assert rc == 0, capsys.readouterr().err  # was: "result.json was made with other settings (spec ...)"
        rows = json.loads((tmp_path / "st" / "study.json").read_text())["rows"]
        assert _numbers(rows) == _numbers(before)
