"""Issue 17, items 4 and 6: a resume continues the run it names (or says in one line what differs), one
process at a time writes a run folder (run.lock), and a stopped torchrun process ends the run on the
others within --dist-timeout instead of hanging it."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from test_train_lifecycle import (
    ARGS,
    dead_pid,
    resume_cfg,
    run_interrupted,
    start,
    tiny_cfg,
    tiny_data,
    wait_for_step,
)
from vitlab.cli import main
from vitlab.errors import VitlabError
from vitlab.train import train
from vitlab.train.run_dir import read_metrics

pytestmark = pytest.mark.usefixtures("keep_torch_threads")  # tests/conftest.py


@pytest.fixture
def interrupted(tmp_path, monkeypatch):
    """A run stopped by Ctrl-C after step 4 of 6 (checkpoints at steps 3 and 4)."""
    return run_interrupted(tmp_path, monkeypatch, step=4)


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ----------------------------------------------------------------- 4a. resume checks what it continues
@pytest.mark.parametrize("change, named", [
    (dict(batch_size=24), "batch_size 16 -> 24"),
    (dict(seed=5), "seed 0 -> 5"),
    (dict(lr=0.01), "lr 0.001 -> 0.01"),
    (dict(epochs=3), "epochs 2.0 -> 3.0"),
    (dict(data="other", classes="a,b", val_fraction=0.2), "data tiny -> other and classes None -> a,b and "
                                                           "val_fraction 0.1 -> 0.2"),
    (dict(model_args="dim=48"), "model_args.dim 32 -> 48"),
])
def test_a_setting_that_changes_the_run_is_refused_naming_it_and_both_values(interrupted, change, named):
    with pytest.raises(VitlabError) as err:
        train(resume_cfg(interrupted, **change), data=tiny_data())
    message = str(err.value)
    assert f"changes the run's {named};" in message and "\n" not in message
    assert f"--allow-change {','.join(change)}" in message
    assert not (interrupted / "run.lock").exists()  # a refusal leaves no lock behind


def test_an_allowed_change_is_recorded_in_config_and_metrics(interrupted, capsys):
    train(resume_cfg(interrupted, epochs=3), data=tiny_data(), allow_change=("epochs",))
    assert yaml.safe_load((interrupted / "config.yaml").read_text())["epochs"] == 3
    changes = [r for r in read_metrics(interrupted) if r["type"] == "change"]
    assert changes == [{"type": "change", "step": 4, "changed": {"epochs": [2.0, 3.0]}}]
    assert "resuming with changed settings (epochs 2.0 -> 3.0)" in capsys.readouterr().err


def _epoch_one_images(monkeypatch, start) -> list[int]:
    """The images of epoch 1 (seed order) that the loader gives a run started by `start()`, as make_loader is asked."""
    import vitlab.data as data_module
    from vitlab.data.loader import batch_indices

    asked, real = [], data_module.make_loader
    monkeypatch.setattr(data_module, "make_loader", lambda ds, b, **kw: asked.append((len(ds), b, kw)) or
                        real(ds, b, **kw))
    start()
    n, batch, kw = next(call for call in asked if call[2].get("shuffle") and call[2]["epoch"] == 1)
    batches = batch_indices(n, batch, shuffle=True, seed=kw["seed"], epoch=1, drop_last=True,
                            skip_samples=kw.get("skip_samples", 0))[kw["skip_batches"]:]
    return torch.cat(batches).tolist()


@pytest.mark.parametrize("batch, gets", [(8, 32), (12, 24)])
def test_an_allowed_batch_size_change_mid_epoch_goes_on_from_the_image_where_it_stopped(interrupted, capsys,
                                                                                         monkeypatch, batch, gets):
    """Resumed at step 4 (epoch 1: one step of 16 images done) at another batch size, the rest of the epoch is the
    images of its order from the 17th on, at the new batch: none comes twice, none is left out (but the last few
    that do not fill a batch, as at any epoch's end). It went on by the step count before, and at batch 8 gave 8
    images of that epoch twice."""
    from vitlab.data.loader import batch_indices

    done = batch_indices(len(tiny_data().train), 16, shuffle=True, seed=0, epoch=1, drop_last=True)[0].tolist()
    rest = _epoch_one_images(monkeypatch, lambda: train(resume_cfg(interrupted, batch_size=batch), data=tiny_data(),
                                                        allow_change=("batch_size",)))
    order = batch_indices(len(tiny_data().train), 48, shuffle=True, seed=0, epoch=1)[0].tolist()
    assert rest == order[16:16 + gets] and not set(rest) & set(done)
    err = capsys.readouterr().err
    total = 4 + gets // batch  # the 2 epochs asked for end with this one (it trained on past them before)
    assert f"batch_size 16 -> {batch} from step 4: the run now has {total} steps at the new batch" in err
    assert "this epoch goes on from image 16 of its order, where it stopped" in err
    assert [r["step"] for r in read_metrics(interrupted) if r["type"] == "step"] == list(range(1, total + 1))
    assert [r["epoch"] for r in read_metrics(interrupted) if r["type"] == "epoch"] == [1, 2]


@pytest.mark.parametrize("stop", [2, 3])
def test_a_batch_size_change_keeps_the_epochs_asked_for(tmp_path, monkeypatch, stop):
    """2 epochs of 48 images: stopped at step 2 (mid-epoch) or 3 (the first epoch's last step) at batch 16 and
    resumed at batch 8, the run trains to the end of its second epoch, not to the new batch's 12 steps."""
    run = run_interrupted(tmp_path, monkeypatch, step=stop)
    train(resume_cfg(run, batch_size=8), data=tiny_data(), allow_change=("batch_size",))
    records = read_metrics(run)
    last = stop + (96 - 16 * stop) // 8  # the images left of the two epochs, in steps of 8
    assert [r["step"] for r in records if r["type"] == "step"] == list(range(1, last + 1))
    assert [r["epoch"] for r in records if r["type"] == "epoch"] == [1, 2]


def test_a_run_resumed_twice_after_a_batch_size_change_is_exact(tmp_path, monkeypatch):
    """After the change, a checkpoint in the middle of that epoch (step 5) records where in the order it stands: a
    resume from it ends with the weights of the changed run going on uninterrupted."""
    import shutil

    from test_train_lifecycle import assert_same_weights, sigint_at_step

    run = run_interrupted(tmp_path, monkeypatch, step=4)
    again = tmp_path / "again"
    shutil.copytree(run, again)
    straight = train(resume_cfg(run, batch_size=12), data=tiny_data(), allow_change=("batch_size",))
    sigint_at_step(monkeypatch, 1, lambda: train(resume_cfg(again, batch_size=12), data=tiny_data(),
                                                 allow_change=("batch_size",)))
    state = torch.load(again / "checkpoints" / "step-0000005.pt", weights_only=False)
    assert state["step_in_epoch"] == 3 and state["epoch_offset"] == -8  # 16 + 12 images: 3 x 12 - 8
    twice = train(resume_cfg(again), data=tiny_data())
    assert_same_weights(straight.model, twice.model)


def test_settings_that_do_not_change_the_run_may_differ(interrupted):
    train(resume_cfg(interrupted, log_every=2, keep_last=3, eval_batch_size=8, dist_timeout=60), data=tiny_data())
    assert not [r for r in read_metrics(interrupted) if r["type"] == "change"]


def test_another_number_of_processes_is_refused(interrupted):
    latest = interrupted / "checkpoints" / "step-0000004.pt"
    state = torch.load(latest, weights_only=True)
    torch.save(dict(state, world_size=2), latest)  # as if written by torchrun --nproc-per-node 2
    with pytest.raises(VitlabError, match=r"ran as 2 processes and is resumed as 1; resume it with `torchrun "
                                          r"--nproc-per-node 2 -m vitlab train --resume RUN`.*--allow-change world_size"):
        train(resume_cfg(interrupted), data=tiny_data())


def test_a_checkpoint_file_that_does_not_fit_the_model_is_one_line(tmp_path, interrupted):
    # a checkpoint copied out of its run folder: no config.yaml, so the settings the checkpoint recorded are the
    # record the command is compared with (audit: without config.yaml nothing was compared)
    lone = tmp_path / "copy" / "checkpoints" / "step-0000004.pt"
    lone.parent.mkdir(parents=True)
    lone.write_bytes((interrupted / "checkpoints" / "step-0000004.pt").read_bytes())
    cfg = tiny_cfg(tmp_path, model_args=dict(dim=48, depth=1, heads=2, mlp_dim=64, patch_size=2), resume=str(lone))
    with pytest.raises(VitlabError, match=r"changes the run's model_args.dim 32 -> 48;"):
        train(cfg, data=tiny_data())
    # the change allowed, the weights still must fit: one line, not torch's list of mismatched tensors
    cfg = tiny_cfg(tmp_path, model_args=dict(dim=48, depth=1, heads=2, mlp_dim=64, patch_size=2), resume=str(lone))
    with pytest.raises(VitlabError, match=r"checkpoint .*step-0000004.pt does not fit the model this command builds"):
        train(cfg, data=tiny_data(), allow_change=("model_args",))


CLI_ARGS = [*ARGS[: ARGS.index("--epochs")], "--steps", "2", *ARGS[ARGS.index("--epochs") + 2:]]


def test_cli_resume_with_other_model_args_is_one_line_not_a_state_dict_dump(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *CLI_ARGS, "--out", str(tmp_path), "--name", "run"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--model-args", "dim=48", "--batch-size", "10"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line == (f"vitlab train: error: cannot resume {run}: this command changes the run's model_args.dim 32 -> 48 "
                    "and batch_size 20 -> 10; drop those settings to continue the run as recorded, or add "
                    "--allow-change model_args,batch_size (config.yaml then records the change)")


# ------------------------------------------------------------------------------ 4b. the run folder's lock
def write_lock(run: Path, pid: int, host: str | None = None) -> None:
    (run / "run.lock").write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(),
                                              "started": "2024-01-01 00:00:00 UTC"}))


def test_a_lock_of_a_live_process_is_refused(interrupted):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(interrupted, holder.pid)
        with pytest.raises(VitlabError, match=rf"run folder {interrupted} is in use by process {holder.pid} on "
                                              rf".*; wait for that run to end or stop it \(kill {holder.pid}"):
            train(resume_cfg(interrupted), data=tiny_data())
        assert json.loads((interrupted / "run.lock").read_text())["pid"] == holder.pid  # left alone
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_lock_on_this_host_is_taken_over_with_a_note(interrupted, capsys):
    pid = dead_pid()
    write_lock(interrupted, pid)
    train(resume_cfg(interrupted), data=tiny_data())
    assert f"left by process {pid} on {socket.gethostname()}" in capsys.readouterr().err
    assert not (interrupted / "run.lock").exists()  # removed at the end


def test_a_lock_of_another_host_needs_force_unlock(interrupted, capsys):
    write_lock(interrupted, 12345, host="node-7")
    with pytest.raises(VitlabError, match=r"locked by process 12345 on node-7 .* another machine; .*--force-unlock"):
        train(resume_cfg(interrupted), data=tiny_data())
    train(resume_cfg(interrupted), data=tiny_data(), force_unlock=True)
    assert "--force-unlock: took over the lock" in capsys.readouterr().err
    assert not (interrupted / "run.lock").exists()


def test_a_resume_while_the_run_still_trains_is_refused_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    # long enough to outlast the second process's start on any machine: it is stopped below, not run to the end
    proc = start(*ARGS, "--epochs", "100", "--out", str(tmp_path), "--name", "run")
    try:
        wait_for_step(proc, run / "metrics.jsonl")
        assert json.loads((run / "run.lock").read_text())["pid"] == proc.pid
        before = (run / "metrics.jsonl").read_text()
        second = subprocess.run([sys.executable, "-m", "vitlab", "train", "--resume", str(run)], capture_output=True,
                                text=True, timeout=300)
        assert second.returncode == 2
        assert f"is in use by process {proc.pid}" in one_error_line(second.stderr)
        assert (run / "metrics.jsonl").read_text().startswith(before)  # not truncated, nothing duplicated
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    assert not (run / "run.lock").exists()


# -------------------------------------------------------------- 6. distributed runs never hang silently
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rank(rank: int, port: int, out: Path, log: Path):
    """One process of a 2-process gloo run, launched as torchrun would (without its agent, so that the test
    decides what happens to each process)."""
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", VITLAB_TEST_STEP_SLEEP="0.3")
    return subprocess.Popen([sys.executable, "-m", "vitlab", "train", *ARGS, "--threads", "1", "--dist-timeout", "3",
                             "--device", "cpu",
                             "--out", str(out), "--name", "run"], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
@pytest.mark.parametrize("stopped", [1, 0])
def test_a_stopped_process_ends_the_run_on_the_other_within_the_timeout(tmp_path, stopped):
    port, run = free_port(), tmp_path / "run"
    procs = [start_rank(r, port, tmp_path, tmp_path / f"rank{r}.log") for r in (0, 1)]
    live = 1 - stopped
    try:
        wait_for_step(procs[0], run / "metrics.jsonl")
        assert json.loads((run / "run.lock").read_text())["pid"] == procs[0].pid  # rank 0 alone takes the lock
        os.kill(procs[stopped].pid, signal.SIGSTOP)
        t0 = time.time()
        rc = procs[live].wait(timeout=120)
        waited = time.time() - t0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = (tmp_path / f"rank{live}.log").read_text()
    assert rc == 2, out
    assert waited < 60, out
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in out, out
    assert errors[0].startswith(f"vitlab train: error: process {live} of 2: another process did not join a "
                                "collective within the --dist-timeout of 3 s"), out
    assert "raise --dist-timeout" in errors[0] and f"--resume {run}" in errors[0]


def _image_folder(root: Path, per_class: int) -> None:
    from PIL import Image

    for c, value in (("a", 40), ("b", 200)):
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            Image.new("L", (14, 14), value + i).save(root / c / f"{i}.png")


def test_a_relative_data_path_is_recorded_absolute_and_other_data_refused(tmp_path, monkeypatch, capsys):
    """`--data folder` was recorded as typed: a resume from another folder trained on whatever ./folder was there
    (same class names, other images) without a word. It is recorded absolute, and a resume whose data differs
    from the checkpoint's record (classes, split sizes) is refused."""
    (tmp_path / "a").mkdir()
    _image_folder(tmp_path / "a" / "folder", 12)
    monkeypatch.chdir(tmp_path / "a")
    argv = ["train", "--data", "folder", "--model", "custom", "--model-args",
            "dim=16,depth=1,heads=2,mlp_dim=32,patch_size=7", "--steps", "6", "--batch-size", "8", "--ckpt-every",
            "2", "--threads", "1", "--precision", "fp32", "--out", str(tmp_path / "runs"), "--name", "r", "--quiet"]
    assert main(argv) == 0
    run = tmp_path / "runs" / "r"
    assert yaml.safe_load((run / "config.yaml").read_text())["data"] == str(tmp_path / "a" / "folder")
    # the checkpoint of step 4, and a run cut back to it, read from another folder with another ./folder
    (tmp_path / "b").mkdir()
    _image_folder(tmp_path / "b" / "folder", 20)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["data"] = "folder"  # as runs recorded it before: relative, in config.yaml and the checkpoint
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    step4 = run / "checkpoints" / "step-0000004.pt"
    state = torch.load(step4, weights_only=True)
    state["config"]["data"] = "folder"
    torch.save(state, step4)
    monkeypatch.chdir(tmp_path / "b")
    capsys.readouterr()
    assert main(["train", "--resume", str(run / "checkpoints" / "step-0000004.pt")]) == 2
    err = capsys.readouterr().err
    assert f"its data '{tmp_path / 'b' / 'folder'}' is not what the run trained on (train" in err
    assert "--allow-change data" in err
    monkeypatch.chdir(tmp_path / "a")  # from the folder it started in: the same data, resumed
    assert main(["train", "--resume", str(run / "checkpoints" / "step-0000004.pt"), "--quiet"]) == 0


def test_a_tuple_in_model_args_is_the_list_config_yaml_records(tmp_path):
    """`model_args={"layers": (1,)}` is written to config.yaml as [1]; the resume compared (1,) with [1] and refused
    the run's own setting as a change (the studies, which pass such specs, could never resume)."""
    from vitlab.train.resume import check_run_settings

    cfg = tiny_cfg(tmp_path, model_args=dict(dim=32, depth=1, heads=2, mlp_dim=64, patch_size=2))
    cfg.model_args = {**cfg.model_args, "image_size": (28, 28)}  # as a study passes a tuple
    cfg.resume = str(tmp_path / "run")
    recorded = {"model_args": {**cfg.model_args, "image_size": [28, 28]}}
    assert check_run_settings(cfg, (), recorded) == {}
    recorded["model_args"]["image_size"] = [32, 32]
    with pytest.raises(VitlabError, match="model_args"):
        check_run_settings(cfg, (), recorded)
