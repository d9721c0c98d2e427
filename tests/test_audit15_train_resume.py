"""Audit 15, "resume anything exactly": data streamed from disk. A run interrupted mid-epoch and resumed must end with
the weights of the run left alone, also when its files are streamed (a DataLoader that draws its workers' seed from
the global RNG, which dropout and stochastic depth use), when the resume changes --eval-every (a setting that does
not change what is trained), and when tar shards are streamed on a resume with another shuffle buffer or core count
(the shards' order depends on both)."""

import os
from pathlib import Path

import pytest
import torch
from PIL import Image

from test_train_lifecycle import sigint_at_step  # a real SIGINT landing in a chosen step
from test_train_loop import tiny_data  # the three-class 8x8 set shared by the training tests
from vitlab.train import resolve_config, train

pytestmark = pytest.mark.usefixtures("keep_torch_threads")  # tests/conftest.py


@pytest.fixture(autouse=True)
def streamed(monkeypatch):
    monkeypatch.setenv("VITLAB_DATA_MEMORY_MB", "0")  # files and shards streamed from disk, not decoded into memory
    monkeypatch.delenv("VITLAB_SHUFFLE_BUFFER", raising=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The tiny set as PNG files: ROOT/{train,val}/CLASS/i.png (42 training images after the test split: 3 steps of 14)."""
    root = tmp_path_factory.mktemp("files")
    data = tiny_data()
    for split in ("train", "val"):
        part = getattr(data, split)
        for i, (x, y) in enumerate(zip(part.images, part.labels)):
            d = root / split / data.class_names[int(y)]
            d.mkdir(parents=True, exist_ok=True)
            Image.fromarray(x[0].numpy()).save(d / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def shards(folder, tmp_path_factory) -> Path:
    from vitlab.cli import main

    out = tmp_path_factory.mktemp("shards") / "s"
    assert main(["data", "shard", str(folder), str(out), "--shard-size", "10", "--quiet"]) == 0
    return out


def cfg_for(tmp_path, data, name, **kw):
    """2 epochs of 3 steps; dropout and stochastic depth draw from the global RNG at every step."""
    base = dict(data=str(data), model="custom", out_dir=str(tmp_path), name=name, device="cpu", threads=1,
                model_args=dict(dim=16, depth=2, heads=2, mlp_dim=32, patch_size=2), drop_path=0.2, dropout=0.1,
                epochs=2, batch_size=14, lr=1e-3, warmup_steps=1, quiet=True, log_every=1, ckpt_every=0,
                inception_crop=False, hflip=True, eval_batch_size=16)
    base.update(kw)
    return resolve_config("small-data", overrides=base)


def interrupted(monkeypatch, cfg, step: int) -> Path:
    """Train until a SIGINT (a user's Ctrl-C) lands in step `step`: the run checkpoints that step and stops."""
    sigint_at_step(monkeypatch, step, lambda: train(cfg))
    return Path(cfg.out_dir) / cfg.name


def resumed(run: Path, **kw):
    return train(resolve_config(None, run / "config.yaml", dict(kw, resume=str(run)))).model


def assert_same_weights(a, b):
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), f"{k} differs after the resume"


def test_streamed_files_resume_mid_epoch_exactly(tmp_path, monkeypatch, folder):
    ref = train(cfg_for(tmp_path, folder, "ref")).model
    run = interrupted(monkeypatch, cfg_for(tmp_path, folder, "cut"), step=5)  # the middle of the second epoch
    assert torch.load(run / "checkpoints" / "step-0000005.pt", weights_only=True)["step_in_epoch"] == 2
    assert_same_weights(ref, resumed(run))


def test_eval_every_changed_on_resume_changes_nothing(tmp_path, monkeypatch, folder):
    """--eval-every may differ on resume (docs/training.md): validating a streamed split must not move the RNG."""
    ref = train(cfg_for(tmp_path, folder, "ref", epochs=3)).model
    run = interrupted(monkeypatch, cfg_for(tmp_path, folder, "cut", epochs=3), step=2)
    assert_same_weights(ref, resumed(run, eval_every=2))  # no validation after the second epoch this time


def test_streamed_shards_resume_with_another_buffer_and_cores(tmp_path, monkeypatch, shards):
    ref = train(cfg_for(tmp_path, shards, "ref")).model
    run = interrupted(monkeypatch, cfg_for(tmp_path, shards, "cut"), step=5)
    state = torch.load(run / "checkpoints" / "step-0000005.pt", weights_only=True)
    monkeypatch.setenv("VITLAB_SHUFFLE_BUFFER", "5")  # another user's setting, or
    monkeypatch.setattr("vitlab.data.loader.default_workers", lambda: 2)  # another machine's cores: both changed the order
    assert_same_weights(ref, resumed(run))
    assert state["stream_order"] == {"workers": max(1, min(8, (os.cpu_count() or 2) // 2)), "buffer": 2000}
