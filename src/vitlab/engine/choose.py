"""`--engine auto`: time the candidate engines once per machine and model shape, keep the choice and the built
artefacts (ONNX files, Inductor kernels) beside the model, and say what was picked and why.

Only engines that give the eager model's logits (`exact_enough`: EXACT_TOL, or 1e-5 of the largest logit) count
as exact; int8 is never picked unless asked for (`--int8`), and then variants whose top-1 agreement with fp32 on
held-out images is not measurably below MIN_AGREEMENT are preferred.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from vitlab.engine import ENGINES, INT8_MODES
from vitlab.engine.locking import folder_lock
from vitlab.errors import VitlabError
from vitlab.runtime import return_freed_memory, timing_input

EXACT_TOL = 1e-3  # logits; fp32 ORT with fusions differs by ~1e-6, anything near 1e-3 is a different model
MIN_AGREEMENT = 0.99
MIN_CALIBRATION = 16  # images; fewer and static int8 falls back to dynamic
# Bumped whenever the ONNX graphs vitlab builds change: artefacts from an older vitlab are rebuilt, not reused.
# 2: fc1's bias in the int8 product (engine/ort.split_gelu_bias). 3: static int8 with fixed activation scales
# (engine/static_int8.py) instead of ORT's QDQ graph.
GRAPH_VERSION = 3
# `--int8 auto` keeps static int8 unless dynamic times this much faster: the two run the same kernels and differ by
# this VM's timing noise (docs/benchmarks.md), and static's logits do not depend on the rest of the batch
STATIC_INT8_MARGIN = 1.05


# ------------------------------------------------------------------------------------------- where
def fingerprint(model: nn.Module) -> str:
    """A hash of the graph version, the config and every weight: artefacts built for other weights or by an
    older vitlab are never reused."""
    from vitlab.engine.digest import chunked_sha256

    def pieces():
        yield f"graphs v{GRAPH_VERSION}".encode()
        yield repr(getattr(model, "config", type(model).__name__)).encode()
        for name, tensor in model.state_dict().items():
            yield name.encode()
            # the tensor's own bytes, without the copy `.tobytes()` made (any dtype: bfloat16 has no numpy type)
            yield tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()

    return chunked_sha256(pieces())[:24]


def _writable(folder: Path) -> bool:
    """A folder to write engines into: writable for this user, and not marked read-only for everyone (root passes
    os.access everywhere, and wrote into a mode-555 folder of shared weights)."""
    try:
        return folder.is_dir() and os.access(folder, os.W_OK) and bool(folder.stat().st_mode & 0o222)
    except OSError:
        return False


def artefact_folder(model: nn.Module, source: str | Path | None = None) -> Path:
    """Beside the model: MODEL_FOLDER/engines/<hash> for a model folder, FILE.engines/<hash> for a file;
    the user cache ($VITLAB_CACHE/engines/<hash>) for registry models or read-only places."""
    from vitlab.weights.hub import cache_dir

    fp = fingerprint(model)
    if source is not None:
        p = Path(source)
        if p.is_dir() and _writable(p) and not _linked(p / "engines" / fp):
            return p / "engines" / fp
        if p.is_file() and _writable(p.parent) and not _linked(p.parent / f"{p.name}.engines" / fp):
            return p.parent / f"{p.name}.engines" / fp
    return cache_dir() / "engines" / fp


def _linked(folder: Path) -> bool:
    """Whether the engines folder beside a model, or its <hash> folder, is a link: a model folder from elsewhere
    can hold one (its author can compute the hash from the weights), and the build wrote vitlab's files wherever
    it pointed. Such a model's engines go to the user cache instead."""
    return folder.parent.is_symlink() or folder.is_symlink()


def machine_key(threads: int) -> str:
    """What a timing depends on besides the model: CPU, threads and library versions."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import onnxruntime

        ort_version = onnxruntime.__version__
    except ImportError:
        ort_version = "none"
    from vitlab.engine.openvino import openvino_version

    return (f"{cpu}|{os.cpu_count()} cpus|{threads} threads|torch {torch.__version__}|ort {ort_version}"
            f"|openvino {openvino_version()}")


# ------------------------------------------------------------------------------------------ timing
PAUSE_S = 0.05  # between timed calls: ORT's spinning threads (and any other engine's) stop before the next one


def interleaved_speeds(engines: dict[str, Callable], x: torch.Tensor, rounds: int = 5) -> dict[str, float]:
    """images/s per engine, calls interleaved in a new order each round (`round_orders`) so a busy moment or a
    neighbour's after-effects hit all alike; a short pause before each call so that no engine's leftover threads
    (ORT spins after a run) slow the next one down."""
    for engine in engines.values():
        engine(x)  # warm-up: kernel choice, memory
    times: dict[str, list[float]] = {name: [] for name in engines}
    for order in round_orders(list(engines), rounds):
        for name in order:
            time.sleep(PAUSE_S)
            t = time.perf_counter()
            engines[name](x)
            times[name].append(time.perf_counter() - t)
    return {name: x.shape[0] / statistics.median(ts) for name, ts in times.items()}


def round_orders(names: list[str], rounds: int, seed: int = 0) -> list[list[str]]:
    """A shuffled order of `names` per round, never starting with the engine that ended the round before. The
    turning order it replaces (A B C, C B A) ran A and C twice in a row and always put B between two others, so
    whatever one engine leaves behind (warm caches, spinning threads) favoured or hurt the same rows every time.
    Seeded: the same candidates are timed in the same orders on every run."""
    rng = random.Random(seed)
    orders: list[list[str]] = []
    for _ in range(rounds):
        order = rng.sample(names, len(names))
        if orders and len(order) > 1 and order[0] == orders[-1][-1]:
            order[0], order[-1] = order[-1], order[0]
        orders.append(order)
    return orders


# ------------------------------------------------------------------------------------------ choice
class _Choices:
    """choices.json in the artefact folder: machine|shape|mode -> what was picked and the measured speeds."""

    def __init__(self, folder: Path):
        self.path = folder / "choices.json"
        self.data = self._read()

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}  # a list or null (edited by hand, another tool): timed again

    def get(self, key: str) -> dict | None:
        """The choice made before for `key`; None where there is none, or with VITLAB_RETIME=1 (time again: a
        choice measured while the machine was busy is not kept forever). An entry that is not what `put` writes
        (no speeds, speeds that are not numbers) counts as none: the notes format its speeds, and a damaged
        cache failed the command with a KeyError or TypeError instead of being timed again."""
        if os.environ.get("VITLAB_RETIME", "").strip() not in ("", "0"):
            return None
        entry = self.data.get(key)
        if not (isinstance(entry, dict) and isinstance(entry.get("picked"), str)):
            return None
        speeds = entry.get("images_per_s")
        if not (isinstance(speeds, dict) and all(type(v) in (int, float) for v in speeds.values())):
            return None
        return entry

    def put(self, key: str, entry: dict) -> None:
        """Record `entry` under `key`, keeping what other processes recorded since this one read the file. Each
        writer has its own temporary file: with one shared name, two commands that finished timing together
        failed ('no such file: choices.tmp') when the other had already moved it into place."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.{threading.get_ident()}.part")
        with folder_lock(self.path.parent):
            self.data = {**self._read(), key: entry}
            try:
                tmp.unlink(missing_ok=True)
                with open(tmp, "x") as handle:  # a new file: never written through a link planted under its name
                    handle.write(json.dumps(self.data, indent=1))
                tmp.replace(self.path)
            finally:
                tmp.unlink(missing_ok=True)


def kept_or_built(folder: Path, files: list[Path], build: Callable[[], object],
                  say_building: Callable[[bool], None] = lambda found: None) -> None:
    """Reuse `files` in `folder` if vitlab built them here and they are unchanged (`engine/trusted.py`), else build
    them under the folder's lock (a command building the same files at once builds, the other waits and reuses
    them), with the links planted in the folder removed first; `say_building(found)` says so, `found`: whether an
    untrusted copy was there."""
    from vitlab.engine.trusted import discard, is_trusted, remember, remove_links

    with folder_lock(folder):
        if is_trusted(files):
            return
        found = discard(files)
        remove_links(folder)
        say_building(found)
        build()
        remember(files)


def announce(engine, command: str, notes: list[str], quiet: bool):
    """Keep the one line saying what runs (`engine.note`) and print it unless `quiet` (commands that must
    first finish reading their inputs print `engine.note` themselves)."""
    engine.note = f"vitlab {command}: engine: " + "; ".join(notes)
    if not quiet:
        print(engine.note, file=sys.stderr)
    return engine


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def reason(exc: BaseException) -> str:
    """One line for why an engine could not be built: vitlab's own message, else the exception's type and start."""
    if isinstance(exc, VitlabError):
        return str(exc)
    text = " ".join(str(exc).split())  # one line: Inductor's errors run over several
    if len(text) > 160:  # cut at a word, and say so: "Set TOR" read like the whole message
        text = text[:160].rsplit(" ", 1)[0] + " ..."
    return f"{type(exc).__name__}: {text}"


def open_or_rebuild(make: Callable, files: list[Path], say_building: Callable[[str], None]):
    """`make()` opens a cached artefact; one that ORT cannot load (truncated by a killed build, edited by hand) is
    removed and built again once, with a note, instead of failing with ORT's own error."""
    try:
        return make()
    except VitlabError:
        raise
    except Exception as exc:  # onnxruntime raises its own exception types for unreadable graphs
        for f in files:
            f.unlink(missing_ok=True)
        say_building(f"again: the cached file could not be loaded ({type(exc).__name__})")
        return make()


def keep_fastest(choices: _Choices, key: str, candidates: dict[str, Callable], x: torch.Tensor,
                 rounds: int = 5) -> tuple[str, dict[str, float]]:
    """Time the candidates on `x`, record the fastest under `key` in the cache; (picked, images/s per name)."""
    speeds = interleaved_speeds(candidates, x, rounds)
    picked = max(speeds, key=speeds.get)
    choices.put(key, {"picked": picked, "images_per_s": {k: round(v, 2) for k, v in speeds.items()},
                      "when": time.strftime("%Y-%m-%d %H:%M:%S")})
    return picked, speeds


class _Builder:
    """Builds (or reuses from the artefact folder) each candidate engine for one model."""

    def __init__(self, model: nn.Module, folder: Path, image_size: tuple[int, int], threads: int,
                 say_building=None):
        self.model, self.folder, self.image_size, self.threads = model.eval(), folder, image_size, threads
        self.say_building = say_building or (lambda what: None)

    def torch(self):
        from vitlab.engine.torch_engines import TorchEngine

        return TorchEngine(self.model)

    def compiled(self):
        from vitlab.engine.torch_engines import CompiledEngine
        from vitlab.weights.hub import cache_dir

        # Inductor's cache holds generated code that runs when loaded: in the user's own cache, never beside the
        # model, where a shared folder could bring its own
        return CompiledEngine(self.model, cache_dir() / "engines" / self.folder.name)

    def _kept_or_built(self, files: list[Path], what: str, build: Callable[[], object]) -> None:
        """Reuse `files` if vitlab built them here and they are unchanged (`engine/trusted.py`), else build them."""
        kept_or_built(self.folder, files, build, lambda found: self.say_building(
            what + (" (the copy found there was not built by vitlab on this machine, or has changed since)"
                    if found else "")))

    def fp32_files(self) -> list[Path]:
        """The fused fp32 graph, and its weights file for a model over 2 GB (`ort.graph_files`)."""
        from vitlab.engine.ort import graph_files

        return graph_files(self.folder / "fp32.onnx", self.model)

    def fp32_path(self) -> Path:
        from vitlab.engine.ort import build_fp32, require_onnxruntime

        require_onnxruntime()  # not installed: said in one line, before any "building" line
        files = self.fp32_files()
        self._kept_or_built(files, "the ONNX Runtime graph", lambda: build_fp32(self.model, self.folder, self.image_size))
        return files[0]

    def onnxruntime(self):
        from vitlab.engine.ort import OrtEngine

        return open_or_rebuild(lambda: OrtEngine(self.fp32_path(), self.threads, flops_per_image=self.flops_per_image()),
                               self.fp32_files(), self.say_building)

    def flops_per_image(self) -> float | None:
        from vitlab.engine.ort import flops_per_image

        return flops_per_image(self.model, self.image_size)

    def openvino_fp32_path(self) -> Path:
        from vitlab.engine.openvino import FP32_IR, build_fp32_ir, ir_files, require_openvino

        require_openvino()  # not installed: said in one line, before any "building" line
        path = self.folder / FP32_IR
        self._kept_or_built(ir_files(path), "the OpenVINO model",
                            lambda: build_fp32_ir(self.model, self.folder, self.image_size))
        return path

    def openvino(self):
        from vitlab.engine.openvino import FP32_IR, OvEngine, ir_files

        return open_or_rebuild(lambda: OvEngine(self.openvino_fp32_path(), self.threads),
                               ir_files(self.folder / FP32_IR), self.say_building)

    def int8(self, mode: str, calibration: list[np.ndarray] | None, tag: str | None = None):
        """The int8 engine of `mode` (a name from `int8_candidates`); the static ones are calibrated on `calibration`,
        whose `calibration_tag` may be given when the caller has it already (hashing 256 images takes a fifth of
        a second)."""
        if mode.startswith("openvino"):
            from vitlab.engine.openvino import FP32_IR, ir_files

            files = [*ir_files(self.folder / FP32_IR), *self.folder.glob("openvino-int8-*")]
            return open_or_rebuild(lambda: self._openvino_int8(mode, calibration, tag), files, self.say_building)
        return open_or_rebuild(lambda: self._int8(mode, calibration, tag),
                               [*self.fp32_files(), *self.folder.glob(f"int8-{mode}*.onnx")], self.say_building)

    def _openvino_int8(self, mode: str, calibration: list[np.ndarray] | None, tag: str | None):
        from vitlab.engine.openvino import OvEngine, build_int8_ir, ir_files

        path = self.folder / f"openvino-int8-static-{tag or calibration_tag(calibration)}.xml"
        self._kept_or_built(ir_files(path), "the OpenVINO static int8 model (calibrating)",
                            lambda: build_int8_ir(self.openvino_fp32_path(), path, calibration or [], self.threads))
        bf16 = mode == "openvino-static-bf16"
        return OvEngine(path, self.threads, name=f"openvino-int8-static{'-bf16' if bf16 else ''}", exact=False,
                        precision="bf16" if bf16 else "f32")

    def _int8(self, mode: str, calibration: list[np.ndarray] | None, tag: str | None):
        from vitlab.engine.ort import OrtEngine, build_int8_dynamic, refuse_int8_over_protobuf_limit
        from vitlab.engine.static_int8 import build_int8_static

        refuse_int8_over_protobuf_limit(self.model)
        if mode == "static":
            # calibrated artefacts depend on the images: rebuilt when the calibration changes
            path = self.folder / f"int8-static-{tag or calibration_tag(calibration)}.onnx"
            self._kept_or_built([path], "the static int8 graph (calibrating)",
                                lambda: build_int8_static(self.fp32_path(), path, calibration or []))
        else:
            path = self.folder / f"int8-{mode}.onnx"
            self._kept_or_built([path], "the dynamic int8 graph", lambda: build_int8_dynamic(self.fp32_path(), path))
        return OrtEngine(path, self.threads, name=f"onnxruntime-int8-{mode}", exact=False,
                         flops_per_image=self.flops_per_image())


def _split_calibration(batches: list[np.ndarray] | None) -> tuple[list[np.ndarray], np.ndarray | None]:
    """Three quarters calibrate, one quarter checks top-1 agreement with fp32 (never the same images)."""
    if not batches:
        return [], None
    images = np.concatenate(batches)
    if len(images) < MIN_CALIBRATION:
        return [], images
    cut = (len(images) * 3) // 4
    calib = [images[i:i + 16] for i in range(0, cut, 16)]
    return calib, images[cut:]


def prepare_engine(
    model: nn.Module,
    engine: str = "auto",
    *,
    int8: str | None = None,
    calibration: list[np.ndarray] | None = None,
    batch_size: int = 32,
    image_size: tuple[int, int] | None = None,
    source: str | Path | None = None,
    command: str = "predict",
    quiet: bool = False,
    progress: bool | None = None,
    sub_batches: bool = True,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The engine that runs `model` for a command. `engine`: auto|torch|onnxruntime|compiled|openvino. `int8`:
    None (exact fp32 engines only) or auto|static|dynamic (ONNX Runtime, and OpenVINO's static int8 where it is
    installed and `engine` is auto or openvino; static calibrated on `calibration`, a list of preprocessed image
    batches). With `auto` or `int8` and `sub_batches`, batches of `batch_size` run
    in sub-batches where those measured faster (`engine/sub_batch.py`). Prints one line saying what runs and why
    (`engine.note`), and with `progress` (default: not quiet) a line before building or timing anything, which
    takes seconds to a minute once."""
    if engine not in ENGINES:
        raise VitlabError(f"--engine {engine!r} is not one of {', '.join(ENGINES)}")
    if int8 is not None and int8 not in INT8_MODES:
        raise VitlabError(f"--int8 {int8!r} is not one of {', '.join(INT8_MODES)}")
    if int8 is not None and engine in ("torch", "compiled"):
        raise VitlabError(f"--int8 runs in ONNX Runtime or OpenVINO; drop --engine {engine} (or use --engine "
                          "onnxruntime or openvino)")
    cfg = model.config
    if int8 is not None:
        _refuse_int8_without_transformer(model)
    size = tuple(image_size or cfg.image_size)
    threads = torch.get_num_threads()
    folder = artefact_folder(model, source)
    if size != tuple(cfg.image_size):
        # the built graphs fix the image size, and the fingerprint knows only the config's: another size keeps its
        # own graphs (a 32 px graph was run on 48 px images, and ONNX Runtime refused them)
        folder = folder.with_name(f"{folder.name}-{size[0]}x{size[1]}")
    show = (not quiet) if progress is None else progress

    def say(text: str) -> None:
        if show:
            print(f"vitlab {command}: engine: {text}", file=sys.stderr, flush=True)

    def say_building(what: str) -> None:
        say(f"building {what} for this model once (kept in {folder})")

    builder = _Builder(model, folder, size, threads, say_building)
    notes: list[str] = []
    if int8 is None and engine != "auto":
        try:
            chosen = getattr(builder, engine)()
            record = _check_record(builder, engine)
            if engine != "torch" and not _checked_before(builder, record):
                # torch.compile's engine keeps the batch of its first call (one static shape): checked at the
                # command's batch, else every batch ran in calls of the check's 2 images
                difference = check_exact(chosen, builder.torch(), cfg.in_chans, size,
                                         batch=batch_size if engine == "compiled" else 2)
                _remember_checked(builder, record, engine, difference)
        except VitlabError:
            raise
        except Exception as exc:  # an exporter or compiler that cannot take this model: one line, not a traceback
            raise _not_built(f"engine {engine}", exc, folder, "use --engine torch") from exc
        notes.append(f"{chosen.name} (as asked)")
    elif int8 is not None:
        try:
            chosen = _choose_int8(builder, int8, calibration, notes, engine, batch_size)
        except VitlabError:
            raise
        except Exception as exc:  # the exporter or ORT's quantizer cannot take this model
            raise _not_built("int8", exc, folder, "run without --int8") from exc
    else:
        chosen = _choose_exact(builder, folder, f"batch {batch_size}|{size[0]}x{size[1]}", batch_size, notes)
    if sub_batches and (engine == "auto" or int8 is not None):
        # fp32 auto times eager PyTorch beside the pick's sub-batches, so what runs is never measured slower
        chosen = _in_best_sub_batches(chosen, builder, batch_size, notes, say,
                                      builder.torch() if int8 is None and chosen.name != "torch" else None)
    # the candidates timed and dropped and the eager reference runs are garbage now: their memory goes back to
    # the OS instead of staying in the heap that tune_cpu_allocator keeps (runtime.return_freed_memory)
    return_freed_memory()
    return announce(chosen, command, notes, quiet)


def _not_built(what: str, exc: BaseException, folder: Path, fix: str) -> VitlabError:
    """The one line for an engine that could not be built: a folder it cannot write to is no fault of the model
    (a read-only model folder and user cache read 'engine onnxruntime cannot run this model (PermissionError ...)')."""
    if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
        return VitlabError(f"{what} cannot write its files in {folder} ({reason(exc)}): set VITLAB_CACHE to a "
                           f"writable folder, or {fix}")
    return VitlabError(f"{what} cannot {'be built for' if what == 'int8' else 'run'} this model ({reason(exc)}); "
                       f"{fix}")


def _refuse_int8_without_transformer(model: nn.Module) -> None:
    """int8 covers the matrix products of a ViT's blocks (convolutions stay fp32: ORT's ConvInteger was slower
    than fp32, docs/benchmarks.md); a CNN would come back fp32 under an int8 name, so it is refused instead."""
    from vitlab.engine.ort import is_vit

    if not is_vit(model):
        name = getattr(model.config, "name", None) or type(model).__name__
        raise VitlabError(f"--int8 quantizes a Vision Transformer's attention and MLP layers; {name} has none "
                          "(its convolutions stay fp32), so drop --int8: --engine auto runs the faster fp32 engine")


def exact_enough(difference: float, scale: float) -> bool:
    """Whether logits `difference` apart are the same model's up to fp32 summation order: EXACT_TOL absolute, or
    1e-5 of the largest logit `scale` for models whose logits run into the thousands (an absolute bound alone
    refused correct engines and exports of such models)."""
    return difference <= max(EXACT_TOL, 1e-5 * scale)


def check_exact(candidate, reference, in_chans: int, size: tuple[int, int], max_diff=_max_diff,
                batch: int = 2) -> float:
    """Refuse an engine whose outputs on `batch` random images differ from the eager model's by more than
    `exact_enough` allows."""
    x = torch.randn(batch, in_chans, *size, generator=torch.Generator().manual_seed(0))
    expected = reference(x)
    logits = expected[0] if isinstance(expected, tuple) else expected  # attention engines: (logits, maps)
    diff = max_diff(candidate(x), expected)
    if not exact_enough(diff, float(logits.float().abs().max())):
        raise VitlabError(f"engine {candidate.name} does not reproduce the model (outputs differ by {diff:.2g}); "
                          "use --engine torch and report this model")
    return diff


def _checked_files(builder: _Builder, engine: str) -> list[Path] | None:
    """The files an engine runs from (None for one that has none: torch.compile's kernels are made in the
    process, and its check is also its compile at the command's batch)."""
    if engine == "onnxruntime":
        return builder.fp32_files()
    if engine == "openvino":
        from vitlab.engine.openvino import FP32_IR, ir_files

        return ir_files(builder.folder / FP32_IR)
    return None


def _check_record(builder: _Builder, engine: str) -> tuple[str, list[str]] | None:
    """(choices.json key, digests of the files it runs) under which a check of `engine` against eager PyTorch is
    recorded; None where it is checked on every start (no files, or files without a trust record). The key holds
    what the logits can depend on besides the files: CPU, threads, library versions, image size."""
    from vitlab.engine.trusted import recorded_digests

    files = _checked_files(builder, engine)
    digests = recorded_digests(files) if files is not None else None
    if digests is None:
        return None
    size = builder.image_size
    return f"{machine_key(builder.threads)}|{size[0]}x{size[1]}|{engine} checked against eager torch", digests


def _checked_before(builder: _Builder, record: tuple[str, list[str]] | None) -> bool:
    """Whether the engine was checked against eager PyTorch (`check_exact`) on this machine, with these library
    versions and threads, on the very files it runs now (`record`). Then the check is not run again: it was the
    largest part of an explicit `--engine onnxruntime` start's `prepare_engine` (0.72 of 1.72 s at ViT-B/16 under
    cProfile, eager PyTorch and the engine on 2 images; docs/results/predict_start_profile.txt), and the same files
    on the same runtime compute the same logits. `auto` reuses its pick without a check on the same grounds.
    VITLAB_RETIME=1 checks (and times) again."""
    if record is None:
        return False
    key, digests = record
    entry = _Choices(builder.folder).get(key)
    return entry is not None and entry.get("digests") == digests


def _remember_checked(builder: _Builder, record: tuple[str, list[str]] | None, engine: str,
                      difference: float) -> None:
    if record is not None:
        key, digests = record
        _Choices(builder.folder).put(key, {"picked": engine, "images_per_s": {}, "max_difference": difference,
                                           "digests": digests, "when": time.strftime("%Y-%m-%d %H:%M:%S")})


def _choose_exact(builder: _Builder, folder: Path, shape: str, batch: int, notes: list[str]):
    choices = _Choices(folder)
    key = f"{machine_key(builder.threads)}|{shape}|fp32"
    cached = choices.get(key)
    if cached and cached["picked"] in ("torch", "onnxruntime", "openvino"):  # what auto picks among
        notes.append(f"{cached['picked']} (auto: chosen before on this machine for {shape.replace('|', ', ')}: "
             f"{_speeds_text(cached['images_per_s'])}; cached in {folder})")
        return getattr(builder, cached["picked"])()
    reference = builder.torch()
    candidates = {"torch": reference}
    left_out = []
    for name in ("onnxruntime", "openvino"):
        try:
            candidates[name] = getattr(builder, name)()
            check_exact(candidates[name], reference, builder.model.config.in_chans, builder.image_size)
        except Exception as exc:  # auto never fails where eager PyTorch works: the candidate is left out, with why
            candidates.pop(name, None)
            left_out.append(f"{name} left out: {reason(exc)}")
    if len(candidates) == 1:  # nothing to compare (the runtimes missing or refused): not timed, not cached
        notes.append("torch (auto: the only candidate here; " + "; ".join(left_out) + ")")
        return reference
    x = timing_input(batch, builder.model.config.in_chans, *builder.image_size)
    picked, speeds = keep_fastest(choices, key, candidates, x)
    notes.append(f"{picked} (auto: measured {_speeds_text(speeds)} at {shape.replace('|', ', ')}; "
         f"cached in {folder})" + "".join(f"; {n}" for n in left_out))
    return candidates[picked]


# each round runs the whole batch once per candidate (4 candidates at batch 32, plus a warm-up call each): about
# 90 s once at ViT-B/16 fp32, batch 32, on the 2-core VM of docs/benchmarks.md, 30 s in int8
SUB_BATCH_ROUNDS = 3


def _in_best_sub_batches(engine, builder: _Builder, batch: int, notes: list[str], say: Callable[[str], None],
                         reference=None):
    """`engine`, or `engine` in sub-batches (`sub_batch.SubBatched`) where those ran faster than whole batches
    of `batch`; timed once per machine, shape and engine, and cached with the engine's choice. `reference` (eager
    PyTorch, where fp32 auto picked another engine) is timed with them and runs instead where it was faster: the
    engine's pick and this timing are minutes apart on a VM whose speed drifts (an OpenVINO pick at 7.8 images/s
    against torch's 7.5 ran at 6.8 in its best sub-batches here), and one interleaved timing settles it."""
    from vitlab.engine.sub_batch import SubBatched, sub_batch_sizes

    sizes = sub_batch_sizes(batch)
    if not sizes:
        return engine
    size = builder.image_size
    choices = _Choices(builder.folder)
    key = f"{machine_key(builder.threads)}|batch {batch}|{size[0]}x{size[1]}|sub-batches of {engine.name}"
    cached = choices.get(key)
    timed = [batch, *sizes]  # the whole batch first
    names = [str(s) for s in timed] + (["torch"] if reference is not None else [])
    if cached and cached["picked"] in names and all(n in cached.get("images_per_s", {}) for n in names):
        picked, speeds, how = cached["picked"], cached["images_per_s"], "chosen before on this machine"
    else:
        say(f"timing {engine.name} at batch {batch} against sub-batches of {', '.join(map(str, sizes))}"
            f"{' and eager torch' if reference is not None else ''} once")
        # each candidate runs the whole batch, its sub-batches back to back as they will run: one small call
        # after a pause would count the waking of the threads once per sub-batch and favour whole batches
        x = timing_input(batch, builder.model.config.in_chans, *size)
        candidates = {str(batch): engine, **{str(s): SubBatched(engine, s) for s in sizes}}
        if reference is not None:
            candidates["torch"] = reference
        picked, speeds = keep_fastest(choices, key, candidates, x, rounds=SUB_BATCH_ROUNDS)
        how = "measured"
    if picked == "torch":
        best = max(timed, key=lambda s: speeds[str(s)])
        notes.append(f"torch after all, whole batches of {batch} (auto, {how} with the sub-batches: "
                     f"{speeds['torch']:.1f} images/s against {engine.name}'s best, "
                     f"{'whole batches' if best == batch else f'sub-batches of {best}'}, {speeds[str(best)]:.1f})")
        return reference
    picked = int(picked)
    others = ", ".join(f"{s}: {speeds[str(s)]:.1f}" for s in timed if s != picked)
    if reference is not None:
        others += f"; torch {speeds['torch']:.1f}"
    if picked == batch:
        notes.append(f"whole batches of {batch} (auto, {how}: {speeds[str(batch)]:.1f} images/s; "
                     f"sub-batches of {others})")
        return engine
    notes.append(f"in sub-batches of {picked} (auto, {how}: {speeds[str(picked)]:.1f} images/s; "
                 f"batches of {others})")
    return SubBatched(engine, picked)


def _speeds_text(speeds: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in sorted(speeds.items(), key=lambda kv: -kv[1])) + " images/s"


def int8_candidates(engine: str, mode: str) -> list[str]:
    """The int8 variants `--engine engine --int8 mode` may run, before calibration is considered: ORT's static and
    dynamic graphs (engine auto|onnxruntime), OpenVINO's static graph with the unquantized rest in fp32 and, where
    the CPU computes bf16, in bf16 (engine auto|openvino, OpenVINO installed)."""
    from vitlab.engine.openvino import bf16_supported, require_openvino

    static, dynamic = [], []
    # asked for by name, a missing runtime says so when it is built; under auto it is just not a candidate
    if engine == "onnxruntime" or (engine == "auto" and importlib.util.find_spec("onnxruntime") is not None):
        static.append("static")
        dynamic.append("dynamic")
    if engine in ("auto", "openvino"):
        try:
            require_openvino()
        except VitlabError:  # not installed: asked for by name, said; under auto, ONNX Runtime's variants only
            if engine == "openvino":
                raise
        else:
            static += ["openvino-static", *(["openvino-static-bf16"] if bf16_supported() else [])]
    if engine == "openvino" and mode == "dynamic":
        raise VitlabError("OpenVINO's int8 is static (calibrated on your images): use --int8 static or auto, "
                          "or --engine onnxruntime for dynamic int8")
    found = {"static": static, "dynamic": dynamic, "auto": static + dynamic}[mode]
    if not found:  # --engine auto without ONNX Runtime, and OpenVINO missing or dynamic int8 asked for
        raise VitlabError("this int8 runs in ONNX Runtime: pip install 'vitlab[onnx]' (OpenVINO's static int8: "
                          "pip install 'vitlab[openvino]')")
    return found


def _choose_int8(builder: _Builder, mode: str, calibration, notes: list[str], engine: str = "auto",
                 batch: int = 32):
    calib, holdout = _split_calibration(calibration)
    modes = int8_candidates(engine, mode)
    if not calib and any(m != "dynamic" for m in modes):
        have = 0 if holdout is None else len(holdout)
        if mode == "static" or engine == "openvino":
            if not have:
                raise VitlabError("static int8 needs calibration images: add --calibration DATA (a folder of your "
                                  "images or a --data source), or use --int8 dynamic with --engine onnxruntime or auto")
            raise VitlabError(f"--int8 static needs at least {MIN_CALIBRATION} calibration images, got {have} "
                              "(--calibration DATA); or use --int8 dynamic with --engine onnxruntime or auto")
        modes = ["dynamic"]
        notes.append(f"int8: {have} calibration images (< {MIN_CALIBRATION}): dynamic quantization" if have else
                     "int8: no calibration images (--calibration DATA for static): dynamic quantization")
    if len(modes) == 1:
        only = builder.int8(modes[0], calib)
        agreement = _agreement(only, builder.torch(), holdout)
        notes.append(f"{only.name}" + (f" (top-1 agrees with fp32 on {agreement[1]} held-out images: "
                                               f"{agreement[0]:.1%})" if agreement else ""))
        return only
    # kept per machine, batch, image size, candidates and calibration images, as the fp32 choice is: a second timing
    # could pick another variant, and the same command would give another score
    choices = _Choices(builder.folder)
    size = builder.image_size
    # the calibration part and the held-out part hashed apart, each once: the static graphs are named by the first
    tag = calibration_tag(calib)
    key = (f"{machine_key(builder.threads)}|batch {batch}|{size[0]}x{size[1]}|int8 {'+'.join(modes)}|"
           f"calibration {tag}+{calibration_tag([holdout])}")
    cached = choices.get(key)
    if cached and cached["picked"] in modes and isinstance(cached.get("detail"), str):
        kept = builder.int8(cached["picked"], calib, tag)
        notes.append(f"{kept.name} ({_int8_label(mode)}, chosen before on this machine: {cached['detail']})")
        return kept
    engines, left_out = _int8_engines_that_build(builder, modes, calib, tag)
    reference = builder.torch()
    agreements = {m: _agreement(e, reference, holdout) for m, e in engines.items()}
    # timed at the command's batch: which runtime wins changes with it (ViT-B/16: ONNX Runtime's int8 at batch 1,
    # OpenVINO's at 32; docs/benchmarks.md), as the fp32 choice is per batch too
    images = np.concatenate(calib)
    x = torch.from_numpy(np.resize(images, (batch, *images.shape[1:])))
    speeds = interleaved_speeds(engines, x)
    good = [m for m in engines if _agrees_enough(agreements[m])] or list(engines)
    picked = max(good, key=lambda m: speeds[m] * (1.0 if m == "dynamic" else STATIC_INT8_MARGIN))
    detail = "; ".join(f"{engines[m].name} {speeds[m]:.1f} images/s, agreement {agreements[m][0]:.1%}"
                       for m in engines)
    detail += f" on {len(holdout)} held-out images" + "".join(f"; {n}" for n in left_out)
    choices.put(key, {"picked": picked, "images_per_s": {m: round(v, 2) for m, v in speeds.items()},
                      "detail": detail, "when": time.strftime("%Y-%m-%d %H:%M:%S")})
    notes.append(f"{engines[picked].name} ({_int8_label(mode)}: {detail})")
    return engines[picked]


def _int8_label(mode: str) -> str:
    """What was timed: `--int8 auto` weighs static against dynamic; `--int8 static` under `--engine auto` times
    static int8 in each runtime (the line said 'int8 auto' there too, naming a choice the user had not asked for)."""
    return "int8 auto" if mode == "auto" else f"int8 {mode}, fastest runtime"


def _int8_engines_that_build(builder: _Builder, modes: list[str], calib, tag: str):
    """The int8 variants that build here, and a note for each that does not: under auto one runtime that cannot take
    the model (an OpenVINO without a kernel for this CPU, say) leaves the others, as for the exact engines. None
    building raises the first failure."""
    engines, left_out, first = {}, [], None
    for mode in modes:
        try:
            engines[mode] = builder.int8(mode, calib, tag)
        except Exception as exc:
            first = first or exc
            left_out.append(f"{mode} left out: {reason(exc)}")
    if not engines:
        raise first
    return engines, left_out


def calibration_tag(batches: list[np.ndarray] | None) -> str:
    """A short hash of the calibration images: what a static graph, or the int8 choice, was made from."""
    digest = hashlib.blake2b(digest_size=8)
    for batch in batches or []:
        digest.update(np.ascontiguousarray(batch).tobytes())
    return digest.hexdigest()


def _agrees_enough(agreement: tuple[float, int] | None) -> bool:
    """Top-1 agreement not measurably below MIN_AGREEMENT: the upper end of its 95 % Wilson interval reaches it.
    On the 64 held-out images of a 256-image calibration one disagreement reads 98.4 %, which says nothing
    against 99 % (interval 91.7-99.7 %); three do (87.1-98.4 %)."""
    from vitlab.evaluate.metrics import wilson_interval

    if not agreement:
        return False
    share, n = agreement
    return wilson_interval(round(share * n), n)[1] >= MIN_AGREEMENT


def _agreement(engine, reference, holdout: np.ndarray | None) -> tuple[float, int] | None:
    """(share of held-out images whose top-1 class matches fp32, how many images)."""
    if holdout is None or not len(holdout):
        return None
    x = torch.from_numpy(holdout)
    ours = torch.cat([engine(b) for b in x.split(32)]).argmax(1)
    ref = torch.cat([reference(b) for b in x.split(32)]).argmax(1)
    return float((ours == ref).float().mean()), len(holdout)
