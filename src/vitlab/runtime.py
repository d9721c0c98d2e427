"""What every command shares: the device, the CPU thread count and the number format, decided once per
command by `setup_runtime` (before anything is loaded) and printed as one line on stderr by `Runtime.announce`.

Threads. Torch's default is one thread per core, which is right on an idle machine and very wrong on a busy
one: OpenMP threads wait on each other while another process holds a core. Measured on the 2-core dev
machine at load ~6.6, one training step took 5.69 s with 2 threads and 0.39 s with 1 (docs/training.md);
`vitlab evaluate RUN --knn` took 378 s against 28 s with OMP_NUM_THREADS=1. So `auto` (no --threads) means
torch's default when the load average is below the number of cores, and 1 thread when it is not.

Precision (`auto|fp32|bf16|fp16|bf16-stem`). On GPUs `auto` is bf16 where the card has it, else fp16 with
loss scaling. On CPUs the flags do not tell whether bf16 pays: on two machines of this project, both
reporting AVX-512 BF16, bf16 was about 2x faster (an AMD EPYC: ViT-Ti/16 training 12.3 vs 6.0 images/s) and
2x slower (an Intel Xeon, family 6 model 207, no AMX exposed: the matrix-product probe below gives 0.52)
than fp32. So `auto` times one bf16 and one fp32 matrix product (about 40 ms, once per machine, torch version and
thread count, then kept in the user's cache: `cpu_bf16_speedup`) and uses
bf16 only where it measured faster, for the models where it was measured to help:
- width >= CPU_BF16_MIN_WIDTH: the whole model under bf16 autocast;
- narrower models with a conv stem: "bf16-stem", the stem's convolutions in bf16, the Transformer in fp32;
- otherwise fp32.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from vitlab.errors import VitlabError

# Measured on the AMD EPYC with benchmarks/train.py, 1 thread: width 64 (the Fashion-MNIST ViT) fp32 496 vs bf16
# 231 images/s; ViT-Ti/16 at 224 px (width 192) fp32 6.0 vs bf16 12.3 images/s (docs/training.md).
CPU_BF16_MIN_WIDTH = 192
# bf16 must beat fp32 by this factor in the matrix-product probe before `auto` uses it: autocast adds casts
# that a small gain does not pay for.
CPU_BF16_MIN_SPEEDUP = 1.3


# ------------------------------------------------------------------------------------------- device
def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """"auto" (or None): the GPU of this process when there is one (LOCAL_RANK under torchrun), else the CPU."""
    if name in (None, "auto"):
        return _gpu_of_this_process() if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise VitlabError(f"unknown device {name!r}; use auto, {_DEVICE_TYPES}") from None
    if dev.type not in _ACCELERATORS and dev.type != "cpu":
        raise VitlabError(f"--device {name}: vitlab runs on {_DEVICE_TYPES}")
    if dev.type != "cpu" and not _ACCELERATORS[dev.type]():
        raise VitlabError(f"--device {dev.type} asked for, but no {_ACCELERATOR_NAMES[dev.type]} is visible; use "
                          "--device cpu")
    if dev.type == "cuda" and dev.index is None:
        return _gpu_of_this_process()
    if dev.type == "cuda" and dev.index >= torch.cuda.device_count():
        last = torch.cuda.device_count() - 1
        raise VitlabError(f"--device {name} asked for, but this process sees {_gpus()} "
                          f"({'cuda:0' if last == 0 else f'cuda:0 to cuda:{last}'})")
    return dev


# Device types a run may name, with how torch says one is there: anything else (meta, a typo torch accepts) fails
# deep inside a command otherwise
_ACCELERATORS = {
    "cuda": lambda: torch.cuda.is_available(),
    "mps": lambda: torch.backends.mps.is_available(),
    "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
}
_ACCELERATOR_NAMES = {"cuda": "CUDA GPU", "mps": "Apple GPU (MPS)", "xpu": "Intel GPU (XPU)"}
_DEVICE_TYPES = "cpu, cuda (or cuda:N), mps (Apple GPUs) or xpu (Intel GPUs)"  # what both refusals offer


def _gpus() -> str:
    count = torch.cuda.device_count()
    return f"{count} GPU" + ("" if count == 1 else "s")


def _gpu_of_this_process() -> torch.device:
    """GPU LOCAL_RANK (0 outside torchrun): one process per GPU, as DDP over NCCL needs. More processes than
    GPUs would fail later in CUDA's own words ("invalid device ordinal")."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.cuda.device_count():
        raise VitlabError(f"this process is torchrun's local rank {local_rank}, but it sees {_gpus()}: start one "
                          f"process per GPU (torchrun --nproc-per-node {torch.cuda.device_count()}), or train on "
                          "the CPU with --device cpu; where each process is given GPUs of its own "
                          "(CUDA_VISIBLE_DEVICES per process), name one: --device cuda:0")
    return torch.device("cuda", local_rank)


# ------------------------------------------------------------------------------------------ threads
def load_average() -> float | None:
    """The 1-minute load average, None where the platform has none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def auto_threads() -> int | None:
    """CPU threads when not given: None (torch's default, one per core) on an idle machine, 1 when the machine
    is already busy (load average >= cores): see the module docstring for why."""
    load = load_average()
    if load is None:
        return None
    return 1 if load >= (os.cpu_count() or 1) else None


def study_threads(given: int | None, recorded: object = None) -> tuple[int, str]:
    """(thread count, why) of every run of a study (compare, study scaling|transfer), decided once: other counts
    give other bits, and an automatic choice per run followed the machine's load. Given, else the count the
    study recorded when it started (a resume), else automatic now."""
    if given is not None:
        if int(given) < 1:
            raise VitlabError(f"--threads must be >= 1, got {given}")
        return int(given), "--threads"
    if isinstance(recorded, int) and recorded >= 1:
        return recorded, "decided when the study started"
    return choose_threads(None)


def choose_threads(requested: int | None) -> tuple[int, str]:
    """(thread count, why) for `--threads requested` (None: automatic)."""
    if requested:
        return int(requested), "--threads"
    chosen = auto_threads()
    load, cores = load_average(), os.cpu_count() or 1
    if chosen is not None:
        return chosen, f"auto: load {load:.1f} >= {cores} cores"
    if load is None:
        return torch.get_num_threads(), "auto: torch's default"
    return torch.get_num_threads(), f"auto: load {load:.1f} < {cores} cores"


# ---------------------------------------------------------------------------------------- precision
def cpu_bf16_supported() -> bool:
    """Whether oneDNN has bf16 kernels on this CPU (the instructions exist; not whether they are fast)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:
        return False


def timing_input(*shape: int) -> torch.Tensor:
    """Random numbers of `shape` for a timing, from a generator of their own. A measurement runs on a machine's first
    use only (then it is cached), so drawing from torch's global generator would move a seeded program's random
    stream on that first run and not on later ones: a user's training loop drew other dropout masks the first time
    its model timed its products (tests/test_timing_rng.py)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _best_seconds(fn, repeats: int) -> float:
    fn()  # first call: kernel selection and memory
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@functools.cache
def _bf16_speedup(threads: int, size: int = 512, repeats: int = 5) -> float:
    a, b = timing_input(size, size), timing_input(size, size)
    a16, b16 = a.bfloat16(), b.bfloat16()
    return _best_seconds(lambda: a @ b, repeats) / _best_seconds(lambda: a16 @ b16, repeats)


def cpu_bf16_speedup() -> float:
    """fp32 time / bf16 time of a 512 x 512 matrix product on this CPU with the current thread count
    (> 1: bf16 is faster); 0.0 without bf16 kernels. Measured once per machine, torch version and thread count
    (about 40 ms) and kept in the user's cache, as `--engine auto` keeps its choice: measured anew by every run,
    a timing near the threshold on a busy machine picked fp32 in one run and bf16 in the next, so two runs of
    one command computed differently. VITLAB_RETIME=1 measures again; VITLAB_CPU_BF16_SPEEDUP=X skips the
    measurement (tests, or to pin a decision)."""
    forced = os.environ.get("VITLAB_CPU_BF16_SPEEDUP")
    if forced:
        return float(forced)
    if not cpu_bf16_supported():
        return 0.0
    threads = torch.get_num_threads()
    return measured_once("cpu_bf16_speedup", machine_key(), lambda: _bf16_speedup(threads))


def machine_key() -> str:
    """What a speed measured here depends on: the CPU model, the torch version and the thread count."""
    return f"{_cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def measured_once(name: str, key: str, measure: Callable[[], float]) -> float:
    """measure() the first time `key` is asked for on this machine, then the value kept in the user's cache file
    `name` (`~/.cache/vitlab/machine/NAME.json`); VITLAB_RETIME=1 measures again."""
    kept = _kept_speedups(name)
    if key in kept and os.environ.get("VITLAB_RETIME") != "1":
        return kept[key]
    value = measure()
    _keep_speedup(key, value, name)
    return value


def machine_cache_file(name: str):
    from vitlab.weights.download import cache_dir

    return cache_dir() / "machine" / f"{name}.json"


def _cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what the platform says: the cache's key."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _kept_speedups(name: str) -> dict[str, float]:
    """The speed ratios measured on this machine before, kept in the user's cache file `name`."""
    import json

    try:
        data = json.loads(machine_cache_file(name).read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}


def _keep_speedup(key: str, speedup: float, name: str) -> None:
    """Best effort: a cache that cannot be written (read-only home) only means measuring again next time."""
    import json

    path = machine_cache_file(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = {**_kept_speedups(name), key: speedup}
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(kept, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


def resolve_precision(precision: str, device: torch.device, model: nn.Module | None = None) -> str:
    """The precision a run uses: `precision` itself unless it is "auto" (rules in the module docstring)."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    cfg = getattr(model, "config", None)
    width = getattr(cfg, "dim", 0) if getattr(cfg, "arch", "vit") == "vit" else 0
    wants_bf16 = width >= CPU_BF16_MIN_WIDTH or bool(getattr(cfg, "conv_stem", ()))
    if not wants_bf16 or cpu_bf16_speedup() < CPU_BF16_MIN_SPEEDUP:
        return "fp32"
    return "bf16" if width >= CPU_BF16_MIN_WIDTH else "bf16-stem"


def set_stem_precision(model: nn.Module, precision: str) -> None:
    """Point a conv stem at bf16 autocast for "bf16-stem", back at the surrounding precision otherwise."""
    stem = getattr(getattr(model, "patch_embed", None), "stem", None)
    if stem is None:
        if precision == "bf16-stem":
            raise VitlabError("--precision bf16-stem needs a model with a conv stem (model_args conv_stem=[...])")
        return
    stem.autocast_dtype = torch.bfloat16 if precision == "bf16-stem" else None


def autocast_context(precision: str, device: torch.device):
    if precision in ("fp32", "bf16-stem"):  # bf16-stem: the stem sets its own autocast
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


# ------------------------------------------------------------------------------------- allocator
def tune_cpu_allocator() -> bool:
    """Keep freed buffers in glibc's heap instead of handing them back to the OS after every step or call.

    By default glibc serves large blocks with mmap and unmaps them on free (the threshold starts at 128 KiB and
    adapts), so each training step and each inference call page-faults its activations in again. Measured on the
    2-core dev machines: training, 274k page faults and 0.70 s system time per 40 steps of the Fashion-MNIST
    model vs 3k and 0.01 s with the thresholds raised (+36 % images per CPU-second, docs/training.md); eager
    inference at batch 1, ViT-S/16 700-4,900 page faults per image vs none (docs/benchmarks.md). ONNX Runtime
    keeps its own arena and is not affected. The cost: memory freed by the process stays with it (up to 1 GiB
    at the top of the heap) instead of going back to the OS. Process-wide; Linux/glibc only; every command that
    computes on the CPU calls it (`setup_runtime`, `vitlab.train`). VITLAB_NO_MALLOPT=1 turns it off."""
    libc = _glibc()
    if libc is None or os.environ.get("VITLAB_NO_MALLOPT"):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 30))


def return_freed_memory() -> bool:
    """Hand the free pages of glibc's heap back to the OS now (`malloc_trim(0)`), wherever they lie in it.

    `tune_cpu_allocator` keeps what the process frees, which a loop that allocates the same activations again
    wants, and which costs a server the memory it used once and never again: the engines `--engine auto` timed
    and dropped, the reference run that checked the chosen engine, the torch weights of a model an ONNX Runtime or
    OpenVINO engine runs instead (`engine.release.release_model`). Called once an engine is ready. True when
    pages went back; Linux/glibc only (False elsewhere)."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


@functools.cache
def _glibc():
    """The C library as a ctypes handle on Linux with glibc, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - musl and others lack them: AttributeError here, not later
        return libc
    except (OSError, AttributeError):
        return None


# ------------------------------------------------------------------------------ CPU-only engines
CPU_ONLY_ENGINES = ("onnxruntime", "compiled", "openvino")


def device_for_engine(device: str | torch.device | None, engine: str = "auto", int8: str | None = None):
    """`--device auto` means the CPU when the engine asked for runs only there (`--engine onnxruntime|compiled|openvino`,
    `--int8`): on a GPU machine `vitlab predict --int8` runs int8 on the CPU instead of refusing. A GPU named
    with such an engine is refused in one line, before anything is loaded."""
    cpu_only = engine in CPU_ONLY_ENGINES or bool(int8)
    if device in (None, "auto") and cpu_only:
        return "cpu"
    if cpu_only and str(device).split(":")[0] in ("cuda", "mps", "xpu"):
        raise VitlabError(f"--engine {engine}{' --int8' if int8 else ''} runs on the CPU; add --device cpu, or drop "
                          "the flag to run on the GPU")
    return device


# ---------------------------------------------------------------------------------- one decision
@dataclass(frozen=True)
class Runtime:
    """What a command computes on, as decided by `setup_runtime`."""

    device: torch.device
    threads: int
    threads_reason: str
    precision: str

    def describe(self, command: str) -> str:
        return (f"vitlab {command}: runtime: device {self.device}, threads {self.threads} ({self.threads_reason}), "
                f"precision {self.precision}")

    def announce(self, command: str, quiet: bool = False) -> None:
        """The one stderr line saying what `command` computes on. Commands call it once their inputs are
        checked, so that a bad path or flag still fails with exactly one line."""
        if not quiet:
            print(self.describe(command), file=sys.stderr)

    def to_dict(self) -> dict:
        return {"device": str(self.device), "threads": self.threads, "precision": self.precision}


def setup_runtime(device: str | torch.device | None = "auto", threads: int | None = None,
                  precision: str = "fp32", model: nn.Module | None = None) -> Runtime:
    """Decide device, threads and precision and set torch's thread count; `Runtime.announce` prints the choice.
    The inference commands compute in fp32 (precision "fp32", the default)."""
    if threads is not None and threads < 1:
        raise VitlabError(f"--threads must be >= 1, got {threads}")
    count, reason = choose_threads(threads)
    torch.set_num_threads(count)
    dev = resolve_device(device)
    if dev.type == "cpu":
        tune_cpu_allocator()
    # threads are set first: the bf16 probe of `auto` is measured with the thread count that will run
    return Runtime(dev, count, reason, resolve_precision(precision, dev, model))
