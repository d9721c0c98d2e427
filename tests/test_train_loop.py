"""The loop on tiny in-test data: run folder contents, gradient accumulation = one big batch,
NaN stops the run with the last good checkpoint kept, fine-tuning from a native checkpoint."""

import json

import pytest
import torch
import torch.nn as nn

from vitlab.data.dataset import DataSplits, ImageDataset
from vitlab.errors import VitlabError
from vitlab.models.registry import create_model
from vitlab.train import resolve_config, train

CLASSES = ["a", "b", "c"]


def tiny_data(n_train=48, n_eval=24, seed=0):
    """Three classes told apart by which third of an 8x8 image is bright (learnable in a few steps)."""
    g = torch.Generator().manual_seed(seed)

    def make(n):
        labels = torch.arange(n) % 3
        images = torch.randint(0, 60, (n, 1, 8, 8), generator=g, dtype=torch.uint8)
        for i, y in enumerate(labels.tolist()):
            images[i, :, :, y * 3:y * 3 + 2] = 220
        return ImageDataset(images, labels, CLASSES, name="tiny")

    return DataSplits(make(n_train), make(n_eval), make(n_eval), CLASSES, name="tiny", channels=1)


def tiny_cfg(tmp_path, **kw):
    base = dict(data="tiny", model="custom", out_dir=str(tmp_path), name="run",
                model_args=dict(dim=32, depth=1, heads=2, mlp_dim=64, patch_size=2),
                epochs=2, batch_size=16, lr=1e-3, warmup_steps=1, threads=1, quiet=True, log_every=1,
                inception_crop=False, hflip=False, label_smoothing=0.0, eval_batch_size=16, ckpt_every=2)
    base.update(kw)
    return resolve_config("small-data", overrides=base)


def test_run_folder_has_everything(tmp_path):
    result = train(tiny_cfg(tmp_path), data=tiny_data())
    run = result.run_dir
    for name in ("config.yaml", "metrics.jsonl", "loss.png", "accuracy.png", "confusion_matrix.png", "summary.json",
                 "model/config.json", "model/model.safetensors", "checkpoints/best.pt"):
        assert (run / name).is_file(), name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    epochs = [r for r in records if r["type"] == "epoch"]
    assert [r["step"] for r in steps] == list(range(1, 7))  # 48 / 16 = 3 steps x 2 epochs
    assert {"loss", "lr", "images_per_s"} <= set(steps[0])
    assert len(epochs) == 2 and {"train_loss", "val_loss", "val_acc", "val_macro_f1"} <= set(epochs[0])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["test_accuracy"] == result.test_metrics["accuracy"]
    assert len(result.history) == 2 and result.images_per_s > 0
    # last K step checkpoints only (keep_last=2)
    assert len(list((run / "checkpoints").glob("step-*.pt"))) == 2
    # the saved model is the trained one
    import vitlab

    loaded = vitlab.load(run / "model")
    for (k, a), b in zip(result.model.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(a.cpu(), b, msg=k)


def test_a_name_that_already_holds_a_run_is_refused_and_left_untouched(tmp_path):
    """A second run under the same --name would mix its metrics and checkpoints into the first's (and --resume
    would then continue the old run's checkpoint); an empty folder made beforehand is fine."""
    (tmp_path / "run").mkdir()
    first = train(tiny_cfg(tmp_path, epochs=1, save_model=False), data=tiny_data())
    before = {p: p.read_bytes() for p in first.run_dir.rglob("*") if p.is_file()}
    with pytest.raises(VitlabError, match=r"already holds a run \(config\.yaml, metrics\.jsonl, summary\.json, "
                                          r"checkpoints/\); continue it with --resume .*or choose another --name"):
        train(tiny_cfg(tmp_path, epochs=1, save_model=False), data=tiny_data())
    assert {p: p.read_bytes() for p in first.run_dir.rglob("*") if p.is_file()} == before


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    data = tiny_data()
    exact = dict(device="cpu", precision="fp32", save_model=False)  # the arithmetic, not a GPU's bf16 (auto there)
    one = train(tiny_cfg(tmp_path, name="one", **exact), data=data)
    acc = train(tiny_cfg(tmp_path, name="acc", micro_batch=4, **exact), data=data)  # 4 x 4 accumulation
    dim = one.model.config.dim
    for (k, a), b in zip(one.model.state_dict().items(), acc.model.state_dict().values()):
        if k.endswith("attn.qkv.bias"):
            # the key bias has no true gradient (softmax ignores a shift shared by all keys): Adam turns its
            # rounding noise into steps, which differ with the summation order (1.3e-5 with oneDNN held to AVX2;
            # q and v biases agree to 4e-10)
            torch.testing.assert_close(a[dim:2 * dim], b[dim:2 * dim], rtol=0, atol=1e-4, msg=k)
            query_and_value = torch.cat([torch.arange(dim), torch.arange(2 * dim, 3 * dim)])
            a, b = a[query_and_value], b[query_and_value]
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=k)


class NanAfter(nn.Module):
    """A model whose output turns NaN from the `bad`-th training forward on."""

    def __init__(self, bad: int):
        super().__init__()
        self.inner = create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=2, image_size=8,
                                  in_chans=1, num_classes=3, seed=0)
        self.calls, self.bad = 0, bad

    def forward(self, x):
        out = self.inner(x)
        if self.training:
            self.calls += 1
            if self.calls >= self.bad:
                out = out * float("nan")
        return out


def test_nan_loss_stops_with_clear_message_and_keeps_checkpoint(tmp_path):
    with pytest.raises(VitlabError, match=r"loss became nan at step 4 .*the last good checkpoint is .*step-0000004"):
        train(tiny_cfg(tmp_path, ckpt_every=2, drop_path=None), model=NanAfter(bad=5), data=tiny_data())
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step-*.pt"))
    assert ckpts, "the last good checkpoint must be kept"
    state = torch.load(ckpts[-1], weights_only=True)
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


def test_finetune_from_native_checkpoint_zero_head_and_sgd(tmp_path):
    data = tiny_data()
    first = train(tiny_cfg(tmp_path, name="pre"), data=data)
    cfg = resolve_config("finetune", overrides=dict(
        weights=str(first.run_dir / "model"), data="tiny", out_dir=str(tmp_path), name="ft", steps=3, batch_size=16,
        warmup_steps=1, threads=1, quiet=True, inception_crop=False, hflip=False, image_size=12, lr=0.01))
    ft = train(cfg, data=data)
    assert ft.model.config.image_size == (12, 12)  # position embeddings resampled to 6x6
    assert ft.model.pos_embed.shape[1] == 1 + 36
    assert ft.test_metrics is not None
