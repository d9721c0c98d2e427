"""A run killed with SIGKILL in the middle of an epoch and resumed ends with exactly the weights of the
same run uninterrupted (deterministic mode, same seed); stochastic depth and augmentation on."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ARGS = [
    "--recipe", "small-data", "--data", "digits", "--per-class", "12", "--model", "custom",
    "--model-args", "dim=32,depth=2,heads=2,mlp_dim=64,patch_size=2", "--batch-size", "20", "--micro-batch", "10",
    "--epochs", "2", "--warmup-steps", "2", "--ckpt-every", "2", "--drop-path", "0.1", "--crop-scale", "0.5,1.0",
    "--seed", "3", "--deterministic", "--threads", "1", "--quiet", "--log-every", "1",
]  # 120 images / 20 = 6 steps per epoch, 12 steps; checkpoints at steps 2, 4 (mid-epoch), 6 (epoch end), ...


def vitlab(*args, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "vitlab", "train", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def test_sigkill_mid_epoch_then_resume_gives_identical_weights(tmp_path):
    ref = vitlab(*ARGS, "--out", str(tmp_path), "--name", "ref")
    env = dict(os.environ, VITLAB_TEST_STEP_SLEEP="0.4")  # slow steps so the kill lands mid-epoch
    victim = vitlab(*ARGS, "--out", str(tmp_path), "--name", "killed", env=env)
    ckdir = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 240
    while time.time() < deadline and not (ckdir / "step-0000004.pt").exists():
        assert victim.poll() is None, victim.stdout.read()
        time.sleep(0.05)
    assert (ckdir / "step-0000004.pt").exists(), "the run never reached its mid-epoch checkpoint"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed" / "model").exists(), "the run was killed too late to test anything"
    latest = sorted(ckdir.glob("step-*.pt"))[-1]
    state = torch.load(latest, weights_only=True)
    assert (state["epoch"], state["step_in_epoch"]) == (0, 4)  # resuming in the middle of the first epoch

    resumed = vitlab("--resume", str(tmp_path / "killed"))
    out_resumed, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out_resumed
    assert "resuming from step" in out_resumed
    out_ref, _ = ref.communicate(timeout=300)
    assert ref.returncode == 0, out_ref

    a = load_file(tmp_path / "ref" / "model" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"
    # the metrics of the resumed run have one record per step, as an uninterrupted run
    steps = [line for line in Path(tmp_path / "killed" / "metrics.jsonl").read_text().splitlines() if '"step"' in line
             and '"type": "step"' in line]
    assert len(steps) == 12
