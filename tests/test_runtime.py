"""One runtime policy for every command: `vitlab.runtime` decides device, threads and precision, each
command takes `--threads`, sets torch's thread count and prints what it chose on one stderr line."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab import runtime
from vitlab.cli import main
from vitlab.data import Preprocess
from vitlab.errors import VitlabError
from vitlab.models import create_model
from vitlab.weights import save_native

CORES = os.cpu_count() or 1


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """Each test starts from 2 threads (more than any --threads 1 below) and leaves the count as it found it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def set_load(monkeypatch, load: float) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))


# ----------------------------------------------------------------------------------- the policy
def test_auto_threads_is_one_on_a_busy_machine_and_torch_default_on_an_idle_one(monkeypatch):
    set_load(monkeypatch, CORES + 0.5)
    assert runtime.auto_threads() == 1
    assert runtime.choose_threads(None) == (1, f"auto: load {CORES + 0.5:.1f} >= {CORES} cores")
    set_load(monkeypatch, 0.0)
    assert runtime.auto_threads() is None
    assert runtime.choose_threads(None) == (2, f"auto: load 0.0 < {CORES} cores")  # torch's current count


def test_no_load_average_means_torch_default(monkeypatch):
    def no_load():
        raise OSError("no load average here")

    monkeypatch.setattr(os, "getloadavg", no_load)
    assert runtime.auto_threads() is None
    assert runtime.choose_threads(None) == (2, "auto: torch's default")


def test_explicit_threads_win_over_the_load(monkeypatch):
    set_load(monkeypatch, 50.0)
    assert runtime.choose_threads(3) == (3, "--threads")


def test_setup_runtime_sets_torch_threads_and_announce_prints_one_line(monkeypatch, capsys):
    set_load(monkeypatch, 50.0)
    rt = runtime.setup_runtime("cpu")
    assert rt.threads == 1 and torch.get_num_threads() == 1 and rt.precision == "fp32"
    assert capsys.readouterr().err == ""  # deciding prints nothing: errors found later stay one line
    rt.announce("evaluate")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"vitlab evaluate: runtime: device cpu, threads 1 (auto: load 50.0 >= {CORES} cores), precision fp32"]
    runtime.setup_runtime("cpu", 2).announce("evaluate", quiet=True)
    assert torch.get_num_threads() == 2 and capsys.readouterr().err == ""


def test_bad_device_is_one_line():
    from vitlab.errors import VitlabError

    with pytest.raises(VitlabError, match="unknown device 'gpu0'"):
        runtime.resolve_device("gpu0")



def test_more_torchrun_processes_than_gpus_is_one_line(monkeypatch):
    """Seen on a 1-GPU machine: torchrun --nproc-per-node 2 with --device auto failed inside CUDA ("invalid device
    ordinal", reported as an unexpected failure). Each process uses GPU LOCAL_RANK, so that must exist."""
    from vitlab.errors import VitlabError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert runtime.resolve_device("auto") == runtime.resolve_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    for name in ("auto", None, "cuda"):
        with pytest.raises(VitlabError, match=r"^this process is torchrun's local rank 1, but it sees 1 GPU: start one "
                                              r"process per GPU \(torchrun --nproc-per-node 1\), or train on the CPU "
                                              r"with --device cpu; where each process is given GPUs of its own "
                                              r"\(CUDA_VISIBLE_DEVICES per process\), name one: --device cuda:0$"):
            runtime.resolve_device(name)
    assert runtime.resolve_device("cuda:0") == torch.device("cuda", 0)  # named by the user: taken as named
    assert runtime.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(VitlabError, match=r"^--device cuda:3 asked for, but this process sees 1 GPU \(cuda:0\)$"):
        runtime.resolve_device("cuda:3")

def test_train_keeps_its_names_through_re_exports():
    from vitlab.train import precision

    for name in ("resolve_precision", "cpu_bf16_supported", "cpu_bf16_speedup", "set_stem_precision",
                 "autocast_context", "CPU_BF16_MIN_WIDTH", "CPU_BF16_MIN_SPEEDUP"):
        assert getattr(precision, name) is getattr(runtime, name)


def test_evaluate_predict_inspect_do_not_import_train():
    """The lower stages no longer reach up into train/ for device, threads or precision."""
    code = ("import sys, vitlab.evaluate, vitlab.evaluate.runner, vitlab.evaluate.features, vitlab.evaluate.loading, "
            "vitlab.runtime, vitlab.commands._load_args, "
            "vitlab.predict, vitlab.commands.evaluate, vitlab.commands.predict, vitlab.commands.inspect, "
            "vitlab.commands.export\n"
            "bad = [m for m in sys.modules if m.startswith('vitlab.train')]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- every command
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny native model for 28 px grey images (bundled data) and two images for predict/inspect."""
    root = tmp_path_factory.mktemp("runtime")
    model = create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=7, image_size=28,
                         in_chans=1, num_classes=3, seed=0)
    save_native(model, root / "w", class_names=["Sandal", "Sneaker", "Ankle boot"],
                preprocess=Preprocess.for_model(28, channels=1))
    images = root / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(images / f"{i}.png")
    return root


def command_lines(tiny, tmp_path):
    w, images = str(tiny / "w"), str(tiny / "images")
    return {
        "evaluate": ["evaluate", w, "--data", "bundled", "--classes", "Sandal,Sneaker,Ankle boot", "--per-class",
                     "5", "--device", "cpu", "--out", str(tmp_path / "ev")],
        "predict": ["predict", w, images, "--device", "cpu"],
        "inspect": ["inspect", w, "--images", images, "--out", str(tmp_path / "in"), "--rollout-images", "1",
                    "--device", "cpu"],
        "export": ["export", w, str(tmp_path / "m.onnx"), "--no-check"],
    }


@pytest.mark.parametrize("command", ["evaluate", "predict", "inspect", "export"])
def test_each_command_takes_threads_and_prints_its_runtime(command, tiny, tmp_path, capsys):
    if command == "export":
        pytest.importorskip("onnx")
    assert main([*command_lines(tiny, tmp_path)[command], "--threads", "1"]) == 0
    assert torch.get_num_threads() == 1
    err = capsys.readouterr().err
    assert f"vitlab {command}: runtime: device cpu, threads 1 (--threads), precision fp32" in err


@pytest.mark.parametrize("command", ["evaluate", "predict", "inspect"])
def test_quiet_hides_the_runtime_line_and_auto_follows_the_load(command, tiny, tmp_path, capsys, monkeypatch):
    set_load(monkeypatch, 50.0)
    assert main([*command_lines(tiny, tmp_path)[command], "--quiet"]) == 0
    assert torch.get_num_threads() == 1  # busy machine, no --threads: 1 thread
    assert "runtime:" not in capsys.readouterr().err


def test_evaluate_records_its_runtime(tiny, tmp_path):
    import json

    assert main([*command_lines(tiny, tmp_path)["evaluate"], "--threads", "1", "--quiet"]) == 0
    info = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert info["info"]["runtime"] == {"device": "cpu", "threads": 1, "precision": "fp32"}


def test_threads_must_be_positive(tiny, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([*command_lines(tiny, tmp_path)["predict"], "--threads", "0"])
    assert "expected a whole number >= 1" in capsys.readouterr().err


def test_compare_takes_threads_and_passes_them_to_fine_tuning():
    import argparse

    from vitlab.commands import compare

    parser = argparse.ArgumentParser()
    compare.register(parser.add_subparsers())
    args = parser.parse_args(["compare", "--data", "bundled", "--models", "custom", "--threads", "1"])
    assert args.threads == 1 and args.device == "auto"
    settings = compare._settings(args)
    assert settings.threads == 1 and "threads" not in settings.train_overrides  # one count for all the models
    args = parser.parse_args(["compare", "--data", "bundled", "--models", "custom"])
    assert compare._settings(args).threads is None  # automatic: decided once when the compare starts


# ----------------------------------------------------------------------------------- the allocator
KEEPS_FREED_MEMORY = """
import os, sys, torch
from vitlab import runtime
runtime.setup_runtime("cpu")
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
before = rss_mb()
x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
del x
print(rss_mb() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator (Linux)")
@pytest.mark.parametrize("opt_out", [False, True])
def test_cpu_commands_keep_freed_memory_unless_told_not_to(opt_out):
    """setup_runtime raises glibc's thresholds (tune_cpu_allocator): a freed 64 MiB tensor stays with the process
    (no page faults when the next call allocates it again); VITLAB_NO_MALLOPT=1 leaves glibc as it comes, which
    hands such a block straight back to the OS."""
    env = {**os.environ, "VITLAB_NO_MALLOPT": "1"} if opt_out else {
        k: v for k, v in os.environ.items() if k != "VITLAB_NO_MALLOPT"}
    out = subprocess.run([sys.executable, "-c", KEEPS_FREED_MEMORY], env=env, capture_output=True, text=True, check=True)
    kept_mb = float(out.stdout.strip())
    assert (kept_mb < 8) if opt_out else (kept_mb > 56)


def test_only_cpu_runtimes_tune_the_allocator(monkeypatch):
    calls = []
    monkeypatch.setattr(runtime, "tune_cpu_allocator", lambda: calls.append(1) or True)
    runtime.setup_runtime("cpu")
    assert calls == [1]


def test_cpu_only_engines_take_the_cpu_when_the_device_is_auto():
    assert runtime.device_for_engine("auto", "onnxruntime") == "cpu"
    assert runtime.device_for_engine("auto", "compiled") == "cpu"
    assert runtime.device_for_engine(None, "auto", "static") == "cpu"
    assert runtime.device_for_engine("auto", "auto") == "auto"
    assert runtime.device_for_engine("auto", "torch") == "auto"
    assert runtime.device_for_engine("cuda", "torch") == "cuda"
    assert runtime.device_for_engine("cpu", "auto", "dynamic") == "cpu"
    with pytest.raises(VitlabError, match=r"--engine auto --int8 runs on the CPU; add --device cpu"):
        runtime.device_for_engine("cuda:1", "auto", "static")
    assert runtime.device_for_engine("gpu", "onnxruntime") == "gpu"  # resolve_device names the unknown device


def test_one_gpu_named_for_every_torchrun_process_is_one_line(monkeypatch):
    """--device cuda:0 under torchrun puts every process on GPU 0, which NCCL refuses after a long wait."""
    from vitlab.errors import VitlabError
    from vitlab.train.distributed import init_distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # GPU 1 is there
    with pytest.raises(VitlabError, match=r"^--device cuda:0 names one GPU for every torchrun process; leave "
                                          r"--device auto \(or cuda\): each process then takes GPU LOCAL_RANK$"):
        init_distributed(torch.device("cuda", 0))


def test_a_process_with_a_gpu_of_its_own_uses_the_one_it_names(monkeypatch):
    """CUDA_VISIBLE_DEVICES per process (SLURM's --gpus-per-task): local rank 1 sees one GPU, cuda:0, its own."""
    import torch.distributed as dist

    from vitlab.train.distributed import init_distributed

    for name, value in (("WORLD_SIZE", "2"), ("RANK", "1"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout: calls.append(("init", backend)))
    info = init_distributed(torch.device("cuda", 0))
    assert calls == [("set_device", torch.device("cuda", 0)), ("init", "nccl")]
    assert (info.rank, info.world_size, info.local_rank, info.backend) == (1, 2, 1, "nccl")


@pytest.mark.parametrize("name, says", [
    ("meta", r"^--device meta: vitlab runs on cpu, cuda \(or cuda:N\), mps \(Apple GPUs\) or xpu \(Intel GPUs\)$"),
    ("mps", r"^--device mps asked for, but no Apple GPU \(MPS\) is visible; use --device cpu$"),
    ("xpu", r"^--device xpu asked for, but no Intel GPU \(XPU\) is visible; use --device cpu$"),
    ("cuda:1", r"^--device cuda asked for, but no CUDA GPU is visible; use --device cpu$"),
])
def test_a_device_this_machine_lacks_is_one_line(monkeypatch, name, says):
    """Before, `--device mps` on a machine without one and `--device meta` failed inside the command ("PyTorch is
    not linked with support for mps devices", "Tensor.item() cannot be called on meta tensors")."""
    from vitlab.errors import VitlabError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(VitlabError, match=says):
        runtime.resolve_device(name)


def test_an_apple_gpu_is_taken_where_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert runtime.resolve_device("mps") == torch.device("mps")
