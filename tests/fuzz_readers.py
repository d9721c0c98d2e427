"""Seeded mutation fuzzing of every file reader: each outcome must be a load, a one-line VitlabError or a
counted bad-file skip, within time and memory bounds.

Run by tests/test_fuzz_readers.py for a short budget in CI; by hand for longer (docs/weights.md, "Fuzzing"):

    python tests/fuzz_readers.py --seconds 600 --seed 1

It builds a valid tiny file for each reader, then repeatedly copies one, mutates it (bit flips, truncation,
inserted bytes, JSON values swapped for hostile ones, .npy headers with other shapes or dtypes, zip size
fields) and reads it back. The process caps its own address space (RLIMIT_AS) at its size after the imports
plus --memory-mb, so an allocation that grows with a hostile header fails as MemoryError (reported as a
finding), and a per-case alarm turns a hang into a finding. It prints one JSON summary line.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import resource
import shutil
import signal
import sys
import time
import traceback
import zipfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from vitlab.errors import VitlabError

HOSTILE_VALUES = [0, -1, 1, 3, 7, 2**31, 200_000, 10**12, 1e-300, -0.5, 3.5, float("nan"), float("inf"),
                  "x", "", None, True, [], {}, [1, 2, 3], [2048, 2048], [0, 0], "gelu", "token"]


# ------------------------------------------------------------------------------------------- fixtures
def _tiny_vit(**kw):
    from vitlab.models.registry import create_model

    args = dict(dim=16, depth=1, heads=2, mlp_dim=32, patch_size=4, image_size=8, num_classes=3, seed=0)
    args.update(kw)
    return create_model("custom", **args)


def _official_npz(path: Path) -> None:
    """A tiny checkpoint in the official Flax layout (the names of vision_transformer's models_vit.py)."""
    from test_weights_hostile import official_arrays  # tests/ is on sys.path: this script's own folder

    np.savez(path, **official_arrays())


def _png(path: Path, size=(6, 5)) -> None:
    from PIL import Image

    Image.fromarray(np.random.default_rng(0).integers(0, 255, (*size, 3), dtype=np.uint8)).save(path)


def build_fixtures(root: Path) -> dict[str, Path]:
    """One valid input per reader, each in its own folder with what it needs beside it (a timm .pth's
    sidecar, a CSV's images), each loading cleanly before any mutation."""
    from vitlab.data.idx import write_idx
    from vitlab.models.registry import create_model
    from vitlab.weights import save_hf, save_native, save_timm

    def home(name: str) -> Path:
        (root / name).mkdir(parents=True, exist_ok=True)
        return root / name

    vit = _tiny_vit()
    fx = {"native": save_native(vit, home("native") / "model", class_names=["a", "b", "c"]),
          "hf": save_hf(vit, home("hf") / "model", class_names=["a", "b", "c"]),
          "timm_safetensors": save_timm(vit, home("timm_safetensors") / "timm.safetensors"),
          "timm_pth": save_timm(vit, home("timm_pth") / "timm.pth")}
    fx["official"] = home("official") / "official.npz"
    _official_npz(fx["official"])
    resnet = create_model("resnet-18-small", base_width=8, num_classes=3, seed=0)
    fx["torchvision_resnet"] = home("torchvision_resnet") / "resnet.pth"
    torch.save(resnet.state_dict(), fx["torchvision_resnet"])
    images = np.random.default_rng(0).integers(0, 255, (6, 4, 4), dtype=np.uint8)
    fx["idx_gz"] = home("idx_gz") / "images-idx3-ubyte.gz"
    write_idx(fx["idx_gz"], images)
    fx["idx"] = home("idx") / "labels-idx1-ubyte"
    write_idx(fx["idx"], np.arange(6, dtype=np.uint8) % 3)
    fx["image"] = home("image") / "image.png"
    _png(fx["image"])
    for i in range(6):
        _png(home("csv") / f"{i}.png")
    fx["csv"] = root / "csv" / "data.csv"
    fx["csv"].write_text("path,label\n" + "".join(f"{i}.png,{'ab'[i % 2]}\n" for i in range(6)))
    cifar = home("cifar") / "cifar-10-batches-bin"
    cifar.mkdir(exist_ok=True)
    record = np.random.default_rng(0).integers(0, 255, (4, 3073), dtype=np.uint8)
    record[:, 0] = np.arange(4) % 10
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        (cifar / name).write_bytes(record.tobytes())
    fx["cifar"] = cifar
    fx["shards"] = _shards(home("shards") / "shards")
    return {k: Path(v) for k, v in fx.items()}


def _shards(folder: Path) -> Path:
    """A WebDataset-layout folder: classes.txt, a training and a test shard, labels as .cls and as .json."""
    import tarfile

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "classes.txt").write_text("a\nb\nc\n")
    for split, count in (("train", 5), ("test", 3)):
        with tarfile.open(folder / f"{split}-000000.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(count):
                _png(folder / "tmp.png", size=(5 + i, 4))
                label_name, label = (f"{i:06d}.json", b'{"label": "b"}') if i % 2 else (f"{i:06d}.cls", b"2")
                for name, data in ((f"{i:06d}.png", (folder / "tmp.png").read_bytes()), (label_name, label)):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    (folder / "tmp.png").unlink()
    return folder


# ------------------------------------------------------------------------------------------- readers
def _read_weights(path: Path):
    from vitlab.weights import load_with_meta

    return load_with_meta(path)


def _read_idx(path: Path):
    from vitlab.data.idx import read_idx

    return read_idx(path)


def _read_image(path: Path):
    from vitlab.data.images import open_image

    return open_image(path)


def _read_csv(path: Path):
    from vitlab.data.files import load_csv

    return load_csv(path, progress=False)


def _read_cifar(path: Path):
    from vitlab.data.load import read_source

    return read_source(f"cifar10:{path.parent}", progress=False)


def _read_shards(path: Path):
    """Load the shard folder, then decode every sample of every split; a bad sample is a counted skip."""
    from vitlab.data.images import BadImageError
    from vitlab.data.shards import load_shards

    splits = load_shards(str(path), progress=False)
    for ds in (splits.train, splits.val, splits.test):
        for i in range(len(ds) if ds is not None else 0):
            try:
                ds.load(i)
            except BadImageError:
                pass
    return splits


READERS: dict[str, Callable[[Path], object]] = {
    "native": _read_weights, "hf": _read_weights, "timm_safetensors": _read_weights, "timm_pth": _read_weights,
    "official": _read_weights, "torchvision_resnet": _read_weights, "idx_gz": _read_idx, "idx": _read_idx,
    "image": _read_image, "csv": _read_csv, "cifar": _read_cifar, "shards": _read_shards,
}


# ------------------------------------------------------------------------------------------- mutations
def _files(target: Path) -> list[Path]:
    return sorted(p for p in ([target] if target.is_file() else target.rglob("*")) if p.is_file())


def flip_bytes(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    if not data:
        return "empty"
    for _ in range(rng.choice([1, 2, 8, 64])):
        i = rng.randrange(len(data))
        data[i] = rng.randrange(256) if rng.random() < 0.5 else data[i] ^ (1 << rng.randrange(8))
    path.write_bytes(bytes(data))
    return "flip"


def truncate(path: Path, rng: random.Random) -> str:
    data = path.read_bytes()
    path.write_bytes(data[: rng.randrange(max(len(data), 1))])
    return "truncate"


def insert_bytes(path: Path, rng: random.Random) -> str:
    data = path.read_bytes()
    i = rng.randrange(len(data) + 1)
    junk = bytes(rng.randrange(256) for _ in range(rng.choice([1, 4, 100])))
    path.write_bytes(data[:i] + junk + data[i:])
    return "insert"


def mutate_json(path: Path, rng: random.Random) -> str:
    """Swap one value (at any depth) for a hostile one, or delete a key."""
    try:
        doc = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return flip_bytes(path, rng)
    slots = []

    def walk(node):
        if isinstance(node, dict):
            for k in node:
                slots.append((node, k))
                walk(node[k])
        elif isinstance(node, list):
            for i in range(len(node)):
                slots.append((node, i))
                walk(node[i])

    walk(doc)
    if not slots:
        return "json-empty"
    node, key = rng.choice(slots)
    if isinstance(node, dict) and rng.random() < 0.2:
        del node[key]
    else:
        node[key] = rng.choice(HOSTILE_VALUES)
    path.write_text(json.dumps(doc))
    return "json"


def mutate_npz(path: Path, rng: random.Random) -> str:
    """Rewrite one member with another shape or dtype in its .npy header (the data is left as it was)."""
    with zipfile.ZipFile(path) as zf:
        members = {i.filename: zf.read(i.filename) for i in zf.infolist()}
    name = rng.choice(sorted(members))
    raw = io.BytesIO(members[name])
    major, _ = np.lib.format.read_magic(raw)
    read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read_header(raw)
    body = members[name][raw.tell():]
    choice = rng.random()
    if choice < 0.4:
        shape = tuple(rng.choice([0, 1, 2, 3, 2**20, 30_000_000]) for _ in range(rng.choice([0, 1, 2, 3, 4])))
    elif choice < 0.7:
        dtype = np.dtype(rng.choice(["<i8", "<f8", "<f2", "|b1", "<c8", "|O", "<U4"]))
    else:
        shape = tuple(reversed(shape))
    out = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": fortran, "shape": shape}
    try:
        np.lib.format.write_array_header_1_0(out, header)
    except ValueError:
        np.lib.format.write_array_header_2_0(out, header)
    members[name] = out.getvalue() + body
    with zipfile.ZipFile(path, "w") as zf:
        for n, b in members.items():
            zf.writestr(n, b)
    return "npz-header"


def mutate_zip_sizes(path: Path, rng: random.Random) -> str:
    """Corrupt a declared size in a zip's local or central header (offsets 22/18 and 24/20)."""
    data = bytearray(path.read_bytes())
    sig = rng.choice([b"PK\x03\x04", b"PK\x01\x02"])
    spots = [i for i in range(len(data) - 4) if data[i:i + 4] == sig]
    if not spots:
        return flip_bytes(path, rng)
    i = rng.choice(spots) + (rng.choice([18, 22]) if sig == b"PK\x03\x04" else rng.choice([20, 24]))
    data[i:i + 4] = rng.choice([0, 1, 2**31 - 1, 2**32 - 1]).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return "zip-size"


def mutate(target: Path, rng: random.Random) -> str:
    file = rng.choice(_files(target))
    ops = [flip_bytes, truncate, insert_bytes]
    if file.suffix == ".json" or file.suffix == ".csv":
        ops += [mutate_json] * 3 if file.suffix == ".json" else []
    if file.suffix in (".npz", ".pth"):
        ops += [mutate_zip_sizes] * 2 + ([mutate_npz] * 3 if file.suffix == ".npz" else [])
    op = rng.choice(ops)
    return f"{file.name}:{op(file, rng)}"


# ------------------------------------------------------------------------------------------- driver
class CaseTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CaseTimeout()


def _where(exc: BaseException) -> str:
    """The innermost vitlab frame of a traceback, where the missing check belongs."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "vitlab" in f.filename]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "outside vitlab"


def classify(reader: Callable[[Path], object], path: Path, limit_s: float) -> tuple[str, str]:
    """('load' | 'refused' | 'finding', detail) for one read."""
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        reader(path)
        return "load", ""
    except VitlabError as exc:  # BadImageError is one too: a bad file, refused or skipped
        text = str(exc)
        return ("refused", "") if "\n" not in text and text else ("finding", f"multi-line VitlabError: {text[:300]}")
    except CaseTimeout:
        return "finding", f"took over {limit_s} s"
    except BaseException as exc:  # noqa: BLE001 - everything else is what the fuzzer is looking for
        return "finding", f"{type(exc).__name__}: {str(exc)[:300]} (at {_where(exc)})"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def cap_memory(extra_mb: int) -> None:
    size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + extra_mb * 2**20, resource.RLIM_INFINITY))


def run(seconds: float, seed: int, work: Path, limit_s: float = 10.0, memory_mb: int = 1500) -> dict:
    import warnings

    warnings.simplefilter("ignore")  # library warnings on corrupt files are not findings
    torch.set_num_threads(1)
    fixtures = build_fixtures(work / "fixtures")
    for name, path in fixtures.items():  # every fixture must load before it is mutated
        outcome, detail = classify(READERS[name], path, 60.0)
        if outcome != "load":
            raise SystemExit(f"fixture {name} does not load: {detail}")
    cap_memory(memory_mb)
    signal.signal(signal.SIGALRM, _alarm)
    rng = random.Random(seed)
    counts: dict[str, Counter] = {name: Counter() for name in fixtures}
    findings: list[dict] = []
    slowest = 0.0
    start = time.perf_counter()
    case = 0
    while time.perf_counter() - start < seconds:
        name = rng.choice(sorted(fixtures))
        home = work / "fixtures" / name  # the reader's folder: its input and what it needs beside it
        shutil.rmtree(work / "case", ignore_errors=True)
        shutil.copytree(home, work / "case")
        target = work / "case" / fixtures[name].relative_to(home)
        what = mutate(work / "case", rng)
        t0 = time.perf_counter()
        outcome, detail = classify(READERS[name], target, limit_s)
        slowest = max(slowest, time.perf_counter() - t0)
        counts[name][outcome] += 1
        if outcome == "finding":
            findings.append({"case": case, "reader": name, "mutation": what, "detail": detail})
        case += 1
    return {"seed": seed, "cases": case, "seconds": round(time.perf_counter() - start, 1),
            "slowest_case_s": round(slowest, 3), "memory_cap_mb": memory_mb,
            "per_reader": {k: dict(v) for k, v in counts.items()}, "findings": findings}


def main(argv: list[str] | None = None) -> int:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit-s", type=float, default=10.0, help="a case slower than this is a finding")
    p.add_argument("--memory-mb", type=int, default=1500, help="address space allowed above the imports")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        summary = run(args.seconds, args.seed, Path(tmp), args.limit_s, args.memory_mb)
    print(json.dumps(summary))
    return 1 if summary["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
