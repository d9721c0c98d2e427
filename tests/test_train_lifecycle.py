"""Run lifecycle (issue 17): numerics recorded and restored on resume, interrupts that checkpoint, a
"last good" checkpoint that is good, and leftovers (half lines, temporary files, a full disk, a truncated
checkpoint) that never block a resume."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import yaml

from test_train_loop import tiny_data  # the three-class 8x8 set shared by the training tests
from vitlab.errors import VitlabError
from vitlab.models.registry import create_model
from vitlab.train import loop, resolve_config, train
from vitlab.train.checkpoint import CheckpointManager, last_finite_checkpoint
from vitlab.train.run_dir import read_metrics


def tiny_cfg(tmp_path, **kw):
    """48 / 16 = 3 steps an epoch, 2 epochs; checkpoints at steps 2, 3 (epoch end), 4, 6."""
    base = dict(data="tiny", model="custom", out_dir=str(tmp_path), name="run", deterministic=True, device="cpu",
                model_args=dict(dim=32, depth=1, heads=2, mlp_dim=64, patch_size=2), drop_path=0.1,
                epochs=2, batch_size=16, lr=1e-3, warmup_steps=1, quiet=True, log_every=1,
                inception_crop=False, hflip=True, label_smoothing=0.0, eval_batch_size=16, ckpt_every=2)
    base.update(kw)
    return resolve_config("small-data", overrides=base)


pytestmark = pytest.mark.usefixtures("keep_torch_threads")  # tests/conftest.py


def set_load(monkeypatch, load: float) -> None:
    """What `auto_threads` sees: 0 = an idle machine, 50 = a busy one (-> 1 thread)."""
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))


def sigint_at_step(monkeypatch, step: int, start) -> None:
    """Call `start()` (a training) until a real SIGINT to this process (a user's Ctrl-C) lands during step `step`
    (from 1): the run checkpoints that step and stops with KeyboardInterrupt."""
    real, calls = loop.params_finite, {"n": 0}

    def spy(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == step:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(loop, "params_finite", spy)
        with pytest.raises(KeyboardInterrupt):
            start()


def run_interrupted(tmp_path, monkeypatch, step=4, **kw) -> Path:
    """Train until a real SIGINT to this process (a user's Ctrl-C) lands during step `step` (from 1)."""
    sigint_at_step(monkeypatch, step, lambda: train(tiny_cfg(tmp_path, **kw), data=tiny_data()))
    return tmp_path / kw.get("name", "run")


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), f"{k} differs"


def resume_cfg(run: Path, **kw):
    """What `vitlab train --resume RUN` builds: the run's config.yaml plus the flags given."""
    return resolve_config(None, run / "config.yaml", dict(kw, resume=str(run)))


# ------------------------------------------------------------------------- 1. exact under any load
def test_resume_under_other_load_restores_threads_and_is_bit_identical(tmp_path, monkeypatch, capsys):
    torch.set_num_threads(2)
    set_load(monkeypatch, 0.0)  # idle: torch's default, 2 threads
    ref = train(tiny_cfg(tmp_path, name="ref"), data=tiny_data())
    assert yaml.safe_load((tmp_path / "ref" / "config.yaml").read_text())["threads"] == 2
    assert re.search(r"threads 2, precision fp32, products (onednn|torch), deterministic on, 1 process",
                     capsys.readouterr().out)

    set_load(monkeypatch, 0.0)
    run = run_interrupted(tmp_path, monkeypatch, step=4)
    assert yaml.safe_load((run / "config.yaml").read_text())["threads"] == 2
    state = torch.load(run / "checkpoints" / "step-0000004.pt", weights_only=True)
    assert state["config"]["threads"] == 2 and state["world_size"] == 1

    set_load(monkeypatch, 50.0)  # busy now: a fresh choice would be 1 thread
    assert loop.auto_threads() == 1
    resumed = train(resume_cfg(run), data=tiny_data())
    assert torch.get_num_threads() == 2
    assert_same_weights(ref.model, resumed.model)


def test_a_different_explicit_setting_on_resume_is_refused_unless_allowed(tmp_path, monkeypatch):
    torch.set_num_threads(2)
    set_load(monkeypatch, 0.0)
    run = run_interrupted(tmp_path, monkeypatch, step=4)
    with pytest.raises(VitlabError, match=r"recorded with threads 2 but the resume asks for 1.*--allow-change threads"):
        train(resume_cfg(run, threads=1), data=tiny_data())
    with pytest.raises(VitlabError, match=r"precision fp32 .* bf16.*--allow-change precision"):
        train(resume_cfg(run, precision="bf16"), data=tiny_data())
    train(resume_cfg(run, threads=1), data=tiny_data(), allow_change=("threads",))
    assert yaml.safe_load((run / "config.yaml").read_text())["threads"] == 1  # the change is recorded
    changes = [r for r in read_metrics(run) if r["type"] == "change"]
    assert changes == [{"type": "change", "step": 4, "changed": {"threads": [2, 1]}}]


def test_allow_change_rejects_unknown_names(capsys):
    from vitlab.cli import main

    assert main(["train", "--allow-change", "lrr", "--data", "digits"]) == 2  # any config field is allowed (item 4)
    assert "unknown training setting 'lrr' (--allow-change lrr); did you mean lr?" in capsys.readouterr().err


# ------------------------------------------------------------------------- 2. interrupts lose nothing
def test_in_process_interrupt_checkpoints_the_step_and_resume_matches(tmp_path, monkeypatch, capsys):
    # the handler the process started with: Python's default_int_handler, or SIG_IGN where the tests were started
    # in the background by a non-interactive shell
    before = signal.getsignal(signal.SIGINT)
    ref = train(tiny_cfg(tmp_path, name="ref", ckpt_every=0), data=tiny_data())
    run = run_interrupted(tmp_path, monkeypatch, step=5, ckpt_every=0)  # no checkpoint planned at step 5
    err = capsys.readouterr().err
    assert f"stopped by SIGINT after step 5; checkpoint {run / 'checkpoints' / 'step-0000005.pt'}" in err
    assert f"resume with: vitlab train --resume {run}" in err
    assert signal.getsignal(signal.SIGINT) is before  # handlers given back
    resumed = train(resume_cfg(run), data=tiny_data())
    assert_same_weights(ref.model, resumed.model)


ARGS = ["--recipe", "small-data", "--data", "digits", "--per-class", "12", "--model", "custom",
        "--model-args", "dim=32,depth=2,heads=2,mlp_dim=64,patch_size=2", "--batch-size", "20", "--epochs", "2",
        "--warmup-steps", "2", "--ckpt-every", "0", "--seed", "3", "--deterministic", "--quiet", "--log-every", "1"]


def start(*args, sleep="0.5"):
    env = dict(os.environ, VITLAB_TEST_STEP_SLEEP=sleep)
    return subprocess.Popen([sys.executable, "-m", "vitlab", "train", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_for_step(proc, metrics: Path) -> None:
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and '"type": "step"' in metrics.read_text()):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"


def test_sigint_in_a_subprocess_checkpoints_prints_the_resume_command_and_resumes(tmp_path):
    run = tmp_path / "run"
    proc = start(*ARGS, "--out", str(tmp_path), "--name", "run")
    wait_for_step(proc, run / "metrics.jsonl")
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    step = int(re.search(r"stopped by SIGINT after step (\d+)", out).group(1))
    assert 1 <= step < 12, out
    assert (run / "checkpoints" / f"step-{step:07d}.pt").is_file()
    assert f"resume with: vitlab train --resume {run}" in out
    resumed = subprocess.run([sys.executable, "-m", "vitlab", "train", "--resume", str(run)], capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming from step {step}" in resumed.stdout
    assert (run / "model" / "model.safetensors").is_file()


def test_a_second_sigint_quits_at_once(tmp_path):
    proc = start(*ARGS, "--out", str(tmp_path), "--name", "run", sleep="30")  # a first step of 30 s
    lines = []
    while not any("run folder" in line for line in lines):  # printed just before the loop starts
        lines.append(proc.stdout.readline())
        assert lines[-1] or proc.poll() is None, "".join(lines)
    time.sleep(1.5)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert time.time() - t0 < 10
    assert "Ctrl-C again quits at once" in out
    assert "stopped by SIGINT" not in out  # it did not wait for the step to finish


# ------------------------------------------------------------------------- 3. "last good" is good
class InfGradAfter(nn.Module):
    """A model whose gradients turn infinite from the `bad`-th training step on, while its loss stays finite."""

    def __init__(self, bad: int):
        super().__init__()
        self.inner = create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=2, image_size=8,
                                  in_chans=1, num_classes=3, seed=0)
        self.calls, self.bad = 0, bad
        self.inner.head.weight.register_hook(lambda g: g * float("inf") if self.calls >= self.bad else g)

    def forward(self, x):
        if self.training:
            self.calls += 1
        return self.inner(x)


def finite_checkpoints(run: Path) -> bool:
    for path in (run / "checkpoints").glob("*.pt"):
        state = torch.load(path, weights_only=True)
        if not all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point()):
            return False
    return True


def test_non_finite_weights_stop_before_the_checkpoint(tmp_path):
    # without clipping nothing looks at the gradients: AdamW turns them into NaN weights, the loss was finite
    with pytest.raises(VitlabError, match=r"the weights became non-finite at step 3 .*before writing a checkpoint, "
                                          r"the last good checkpoint is .*step-0000003\.pt"):
        train(tiny_cfg(tmp_path, grad_clip=0, ckpt_every=1, drop_path=None), model=InfGradAfter(bad=4), data=tiny_data())
    run = tmp_path / "run"
    assert CheckpointManager(run / "checkpoints").latest().name == "step-0000003.pt"
    assert finite_checkpoints(run)


def test_non_finite_gradients_stop_before_the_update(tmp_path):
    with pytest.raises(VitlabError, match=r"the gradient norm became (inf|nan) at step 4 .*step-0000004\.pt"):
        train(tiny_cfg(tmp_path, grad_clip=1.0, drop_path=None), model=InfGradAfter(bad=5), data=tiny_data())
    assert finite_checkpoints(tmp_path / "run")


def test_last_good_checkpoint_skips_one_with_nan_weights(tmp_path):
    ckpts = CheckpointManager(tmp_path, keep_last=5)
    ckpts.save({"model": {"w": torch.ones(3)}}, 2)
    ckpts.save({"model": {"w": torch.tensor([1.0, float("nan"), 1.0])}}, 4)
    assert last_finite_checkpoint(tmp_path).name == "step-0000002.pt"


# ------------------------------------------------------------------------- 5. leftovers never block
def dead_pid() -> int:
    pid = 999_999
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1


def test_half_line_temp_files_and_truncated_checkpoint_do_not_block_resume(tmp_path, monkeypatch, capsys):
    ref = train(tiny_cfg(tmp_path, name="ref"), data=tiny_data())
    run = run_interrupted(tmp_path, monkeypatch, step=5)  # checkpoints at 4 and 5 (keep_last 2)
    capsys.readouterr()
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write('{"type": "step", "step": 6, "lo')  # a kill in the middle of an append
    stale = [run / "checkpoints" / f".step-0000006.pt.tmp-{dead_pid()}", run / f".summary.json.tmp-{dead_pid()}"]
    for p in stale:
        p.write_bytes(b"half a file")
    latest = run / "checkpoints" / "step-0000005.pt"
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])  # a truncated latest checkpoint
    assert read_metrics(run)[-1]["step"] == 5  # readers skip the half line too

    resumed = train(resume_cfg(run), data=tiny_data())
    shown = capsys.readouterr()
    assert "dropped 1 incomplete line(s)" in shown.err
    assert "removed 2 temporary file(s)" in shown.err and not any(p.exists() for p in stale)
    assert "step-0000005.pt is unreadable" in shown.err
    assert "resuming from step 4" in shown.out
    assert_same_weights(ref.model, resumed.model)  # resumed from step 4 instead, still exact


def test_full_disk_during_a_checkpoint_is_one_line_and_leaves_no_temp_file(tmp_path, monkeypatch):
    import vitlab.train.checkpoint as ck

    def full_disk(obj, fh):
        fh.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck.torch, "save", full_disk)
    with pytest.raises(VitlabError, match=r"no space left to write a checkpoint in .*checkpoints: it needs about "
                                          r"[0-9.]+ MiB \(.* free\); free disk space there"):
        train(tiny_cfg(tmp_path), data=tiny_data())
    assert not [p for p in (tmp_path / "run").rglob("*") if ".tmp-" in p.name]


def test_torch_zip_writer_failure_on_a_full_disk_is_named_too(tmp_path, monkeypatch):
    import shutil

    import vitlab.train.checkpoint as ck

    def failing(obj, fh):
        fh.write(b"x" * 1000)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file")

    monkeypatch.setattr(ck.torch, "save", failing)
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 30, 10 << 30, 1000))
    with pytest.raises(VitlabError, match=r"no space left to write a checkpoint"):
        ck.atomic_save({"w": torch.ones(1000)}, tmp_path / "c.pt")
    assert list(tmp_path.iterdir()) == []


def test_wall_time_in_summary_adds_up_all_segments(tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_TEST_STEP_SLEEP", "0.3")
    run = run_interrupted(tmp_path, monkeypatch, step=4)
    first = torch.load(run / "checkpoints" / "step-0000004.pt", weights_only=True)["wall_time_s"]
    assert first >= 4 * 0.3
    t0 = time.perf_counter()
    train(resume_cfg(run), data=tiny_data())
    second = time.perf_counter() - t0
    wall = json.loads((run / "summary.json").read_text())["wall_time_s"]
    # the resumed segment sleeps through steps 5 and 6; the plots and files written after the count are not in it
    # (more than half of the segment on a loaded machine)
    assert first + 2 * 0.3 <= wall <= first + second + 1


def test_cpu_time_in_summary_adds_up_segments_and_is_the_runs_own(tmp_path, monkeypatch):
    """summary.json's process_cpu_time_s had counted the whole process: a resumed run's earlier segments were
    lost, and a second run in one process (compare, a notebook) counted the first one's CPU time too."""
    run = run_interrupted(tmp_path, monkeypatch, step=4)
    first = torch.load(run / "checkpoints" / "step-0000004.pt", weights_only=True)["cpu_time_s"]
    assert 0 < first
    c0 = time.process_time()
    train(resume_cfg(run), data=tiny_data())
    second = time.process_time() - c0
    cpu = json.loads((run / "summary.json").read_text())["process_cpu_time_s"]
    assert first < cpu <= first + second
    c0 = time.process_time()  # a fresh run in the same process counts its own time alone
    train(tiny_cfg(tmp_path, name="fresh"), data=tiny_data())
    fresh = json.loads((tmp_path / "fresh" / "summary.json").read_text())["process_cpu_time_s"]
    assert 0 < fresh <= time.process_time() - c0


@pytest.mark.parametrize("warmup, said", [(1, False), (5, False), (6, True), (100, True)])
def test_a_warm_up_that_takes_the_whole_run_is_said(tmp_path, capsys, warmup, said):
    """6 steps: with a warm-up of 6 or more the learning rate only rises (capped to the run, not refused)."""
    train(tiny_cfg(tmp_path, warmup_steps=warmup, ckpt_every=0), data=tiny_data())
    err = capsys.readouterr().err
    notice = [line for line in err.splitlines() if "warm-up" in line]
    assert len(notice) == int(said), err
    if said:
        # the model line says the capped warm-up; where it was capped, this line names what was asked for
        asked = "the warm-up" if warmup == 6 else f"the warm-up asked for ({warmup} steps)"
        assert notice[0].startswith(f"vitlab: {asked} is as long as the run (6 steps)"), notice


def test_resuming_a_finished_run_says_it_is_complete(tmp_path, capsys):
    """`vitlab train --resume RUN` on a finished run redid its test pass and rewrote summary.json without a word."""
    run = train(tiny_cfg(tmp_path, name="done"), data=tiny_data()).run_dir
    capsys.readouterr()
    train(resume_cfg(run), data=tiny_data())
    out = capsys.readouterr().out
    assert "vitlab: the run is complete" in out and "nothing left to train" in out


def test_train_gives_back_the_threads_and_deterministic_mode_it_found(tmp_path, monkeypatch):
    """`vitlab.train` from a program: the run computes with its own thread count and deterministic kernels, and the
    program has its own back afterwards, also where the run fails (a notebook kept deterministic-only kernels)."""
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(False)
    result = train(tiny_cfg(tmp_path, threads=1, deterministic=True, epochs=1), data=tiny_data())
    recorded = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert recorded["threads"] == 1 and recorded["deterministic"] is True
    assert torch.get_num_threads() == 2 and not torch.are_deterministic_algorithms_enabled()
    seen = []

    def failing_setup(run, *args):  # a run that fails once its settings are made
        seen.append((torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()))
        raise VitlabError("no such data")

    monkeypatch.setattr(loop.TrainingRun, "setup", failing_setup)
    with pytest.raises(VitlabError, match="no such data"):
        train(tiny_cfg(tmp_path, name="failed", threads=1, deterministic=True), data=tiny_data())
    assert seen == [(1, True)]
    assert torch.get_num_threads() == 2 and not torch.are_deterministic_algorithms_enabled()
