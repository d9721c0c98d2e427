"""`vitlab compare` always finishes and resumes: a failing model is a row saying why, a killed study
reruns only the unfinished models, other settings on the same --out are refused, and official names
and run folders resolve as in every other command."""

import csv
import json
import shutil
from pathlib import Path

import pytest

import vitlab.experiments.compare as cmp
from vitlab.cli import main

TINY = "custom(dim=16,depth=1,heads=2,mlp_dim=32,patch_size=7)"
OTHER = "custom(dim=16,depth=1,heads=2,mlp_dim=24,patch_size=7)"
DATA = ["--data", "bundled", "--classes", "Sandal,Sneaker,Ankle boot", "--per-class", "10"]
BUDGET = ["--epochs", "1", "--lr", "1e-3", "--batch-size", "10", "--precision", "fp32", "--quiet"]
REAL_FINETUNE = cmp._finetune
FIX = Path("/work/shared/fixtures/official/tiny_token_linen.npz")


def _compare(out, models, *extra):
    return main(["compare", *DATA, "--models", models, *BUDGET, "--out", str(out), *extra])


def _count_finetunes(monkeypatch, fail: dict | None = None):
    """Wrap the fine-tuning step: count it per model, raise `fail[name]` for the named models."""
    calls: list[str] = []

    def wrapped(model, lm, zs, ms, *args, **kwargs):
        calls.append(ms.name)
        if fail and ms.name in fail:
            raise fail[ms.name]
        return REAL_FINETUNE(model, lm, zs, ms, *args, **kwargs)

    monkeypatch.setattr(cmp, "_finetune", wrapped)
    return calls


def _csv(out):
    with (out / "compare.csv").open() as f:
        return list(csv.DictReader(f))


def test_failures_do_not_lose_the_others(tmp_path, monkeypatch, capsys):
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    out = tmp_path / "cmp"
    _count_finetunes(monkeypatch, fail={OTHER: RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")})
    rc = _compare(out, f"{TINY},bad,{OTHER}", f"--weights=-,{tmp_path / 'junk.safetensors'},-")
    assert rc == 2  # non-zero: a script must notice the missing rows
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("vitlab compare: error: 2 of 3 models failed: bad (loading: ")
    assert f"{OTHER} (fine-tuning: RuntimeError: CUDA out of memory" in err[-1]
    rows = _csv(out)
    assert [r["model"] for r in rows] == [TINY, "bad", OTHER]
    assert [r["status"] for r in rows] == ["ok", "failed", "failed"]
    assert rows[0]["error"] == "" and float(rows[0]["fine_tuned_accuracy"]) > 0
    assert rows[1]["error"].startswith("loading: ") and rows[2]["error"].startswith("fine-tuning: RuntimeError")
    assert rows[2]["zero_shot_evaluation"] == "" and rows[2]["fine_tuned_accuracy"] == ""
    for f in ("val_loss.png", "val_accuracy.png", "runtime.png", "history.csv", "compare.json"):
        assert (out / f).stat().st_size > 0, f
    assert "Traceback" in (out / cmp._safe(OTHER) / "error.txt").read_text()
    md = (out / "compare.md").read_text()
    assert "FAILED (fine-tuning: RuntimeError: CUDA out of memory" in md and f"**Failed: bad, {OTHER}**" in md
    assert "diverges again with the same settings" in md  # retrying alone cannot mend a diverged run
    summary = json.loads((out / "compare.json").read_text())
    assert summary["failed"] == ["bad", OTHER] and summary["mcnemar"] == []
    assert not (out / cmp._safe(OTHER) / "result.json").exists()  # a failed model is retried on the next run


def test_killed_study_resumes_without_redoing_finished_models(tmp_path, monkeypatch, capsys):
    out = tmp_path / "cmp"
    second = OTHER
    models = f"{TINY},{second}"
    calls = _count_finetunes(monkeypatch, fail={second: KeyboardInterrupt()})  # killed in the 2nd model
    assert _compare(out, models) == 130
    assert calls == [TINY, second]
    first = json.loads((out / cmp._safe(TINY) / "result.json").read_text())
    assert first["status"] == "ok" and not (out / cmp._safe(second) / "result.json").exists()

    calls = _count_finetunes(monkeypatch)
    assert _compare(out, models) == 0
    assert calls == [second]  # the first model is not retrained
    summary = json.loads((out / "compare.json").read_text())
    assert [r["model"] for r in summary["models"]] == [TINY, second]
    assert summary["models"][0] == first  # reused as stored
    assert [h["epoch"] for h in summary["models"][1]["history"]] == [0, 1]
    assert len(summary["mcnemar"]) == 1 and len(_csv(out)) == 2

    calls = _count_finetunes(monkeypatch)  # --resume OUT: the same; nothing left to do
    assert main(["compare", *DATA, "--models", models, *BUDGET, "--resume", str(out)]) == 0
    assert calls == []

    capsys.readouterr()  # other settings on the same folder: one clear line, nothing mixed
    assert _compare(out, models, "--lr", "1e-2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "result.json was made with other settings" in err[0] and "lr 0.001 -> 0.01" in err[0]
    assert calls == []
    assert main(["compare", *DATA, "--models", models, *BUDGET, "--resume", str(tmp_path / "nope")]) == 2


def test_official_names_and_run_folders_resolve(tmp_path, monkeypatch):
    if not FIX.is_file():
        pytest.skip("official fixtures not available")
    # an official name resolves through vitlab.weights.hub.resolve, here from the download cache
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    cached = tmp_path / "cache" / "official" / "imagenet21k" / "ViT-B_16.npz"
    cached.parent.mkdir(parents=True)
    shutil.copy(FIX, cached)
    out = tmp_path / "a"
    assert _compare(out, "official", "--weights", "ViT-B_16.npz") == 0
    r = json.loads((out / "compare.json").read_text())["models"][0]
    assert r["source"] == "pretrained" and r["weights_path"] == str(cached)
    assert r["zero_shot_label"] == "zero-shot (fresh head, chance)"  # 10 unnamed outputs, 3 classes
    # the fine-tuning run folder, as a model and as --weights
    run = r["run_dir"]
    out = tmp_path / "b"
    assert _compare(out, f"{run},again", f"--weights=-,{run}") == 0
    rows = json.loads((out / "compare.json").read_text())["models"]
    assert [x["source"] for x in rows] == ["vitlab run", "vitlab run"]
    assert all(x["zero_shot_label"] == "trained head" for x in rows)  # the run's head knows the classes


def test_a_model_cut_short_resumes_its_finetuning_exactly(tmp_path, monkeypatch, capsys):
    """Killed after the fine-tuning's first checkpoint, the model resumes from it on the rerun (not from step 0)
    and ends with the numbers of a run never cut short; other settings start that model over."""
    from vitlab.train.loop import TrainingRun

    budget = ["--epochs", "2"]  # a checkpoint at the end of epoch 1, then the kill
    real_save, saved = TrainingRun.save_checkpoint, []

    def save_then_kill(self, *args, **kwargs):
        real_save(self, *args, **kwargs)
        saved.append(self.progress.global_step)
        raise KeyboardInterrupt

    monkeypatch.setattr(TrainingRun, "save_checkpoint", save_then_kill)
    out = tmp_path / "cut"
    assert _compare(out, TINY, *budget) == 130
    monkeypatch.setattr(TrainingRun, "save_checkpoint", real_save)
    first_ckpt = saved[0]
    assert first_ckpt > 0 and not (out / cmp._safe(TINY) / "result.json").exists()

    capsys.readouterr()
    resumed_steps: list[int] = []
    real_restore = TrainingRun.restore

    def restore(self, state):
        resumed_steps.append(state["global_step"])
        return real_restore(self, state)

    monkeypatch.setattr(TrainingRun, "restore", restore)
    assert _compare(out, TINY, *budget) == 0
    assert resumed_steps == [first_ckpt]
    assert "resuming its fine-tuning from" in capsys.readouterr().out
    assert _compare(tmp_path / "whole", TINY, *budget) == 0  # the same study, never cut short
    assert resumed_steps == [first_ckpt]

    def numbers(folder):
        r = json.loads((folder / "compare.json").read_text())["models"][0]
        history = [{k: v for k, v in h.items() if k not in ("time_s", "images_per_s")} for h in r["history"]]
        return r["fine_tuned"]["head"], r["fine_tuned_correct"], history

    assert numbers(out) == numbers(tmp_path / "whole")

    # cut short again, then rerun with another learning rate: that model starts over
    monkeypatch.setattr(TrainingRun, "save_checkpoint", save_then_kill)
    shutil.rmtree(out)
    assert _compare(out, TINY, *budget) == 130
    monkeypatch.setattr(TrainingRun, "save_checkpoint", real_save)
    resumed_steps.clear()
    assert _compare(out, TINY, *budget, "--lr", "1e-2") == 0
    assert resumed_steps == []
