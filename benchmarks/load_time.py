"""How long loading saved weights into a ready model takes: vitlab against timm and Hugging Face, in one process.

    /work/peers/bin/python benchmarks/load_time.py                        # ViT-B/16, with the peers
    /work/peers/bin/python benchmarks/load_time.py --models vit-ti/16,vit-l/16 --rounds 9
    .venv/bin/python benchmarks/load_time.py                               # vitlab's rows only

Each model is saved once in each library's own format (random weights), then each round loads every row once, in
a new random order, and the table gives the median time of each row and its ratio to the fastest peer:

- `vitlab.load(folder)`: vitlab's folder (config.json + model.safetensors); and the same model as the official
  code's .npz (flax names and layouts, converted as it loads), read as now and as before (numpy's reads and transposes);
- the same with the model built and randomly initialised first, then the weights copied in: how `vitlab.load`
  worked before it built on the meta device (`registry.build_unfilled`), kept as a row to show what that saves;
- `timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=...))` on timm's safetensors file;
- `transformers.ViTForImageClassification.from_pretrained(folder)` on its own folder.

`--rewrite-check` shows what each library's loaded model does when its file is then rewritten in place;
`--digests` times the digest of the weights that every engine start (predict, evaluate, serve) computes.

Load time is a cold start's cost: `vitlab predict`, `vitlab serve` and every script that loads a model pay it
before the first image. Run it on an idle machine; timings of a 2-core VM move by 10-30 % between runs.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

import vitlab
from vitlab.models.registry import build_model
from vitlab.weights import read_checkpoint

TIMM_NAMES = {"vit-ti/16": "vit_tiny_patch16_224", "vit-s/16": "vit_small_patch16_224",
              "vit-b/16": "vit_base_patch16_224", "vit-l/16": "vit_large_patch16_224"}


def load_built_first(folder: Path) -> torch.nn.Module:
    """vitlab's load as it was: build the model (random initialisation), then copy the file's weights in."""
    config, sd, _ = read_checkpoint(folder)
    model = build_model(config)
    model.load_state_dict(sd, strict=True)
    return model.eval()


def official_npz(model: torch.nn.Module, path: Path) -> Path:
    """`model` (a plain class-token ViT) written as the official code's .npz (flax names and layouts)."""
    import numpy as np

    cfg, sd = model.config, {k: v.detach().numpy() for k, v in model.state_dict().items()}
    d, h = cfg.dim, cfg.heads
    a = {"cls": sd["cls_token"], "embedding/kernel": sd["patch_embed.proj.weight"].transpose(2, 3, 1, 0),
         "embedding/bias": sd["patch_embed.proj.bias"], "head/kernel": sd["head.weight"].T, "head/bias": sd["head.bias"],
         "Transformer/posembed_input/pos_embedding": sd["pos_embed"],
         "Transformer/encoder_norm/scale": sd["norm.weight"], "Transformer/encoder_norm/bias": sd["norm.bias"]}
    for i in range(cfg.depth):
        p, q = f"Transformer/encoderblock_{i}/", f"blocks.{i}."
        for ln, ours in (("LayerNorm_0", "norm1"), ("LayerNorm_2", "norm2")):
            a[f"{p}{ln}/scale"], a[f"{p}{ln}/bias"] = sd[q + ours + ".weight"], sd[q + ours + ".bias"]
        for j, fc in ((0, "fc1"), (1, "fc2")):
            a[f"{p}MlpBlock_3/Dense_{j}/kernel"] = sd[f"{q}mlp.{fc}.weight"].T
            a[f"{p}MlpBlock_3/Dense_{j}/bias"] = sd[f"{q}mlp.{fc}.bias"]
        att = f"{p}MultiHeadDotProductAttention_1/"
        weights, biases = np.split(sd[q + "attn.qkv.weight"], 3), np.split(sd[q + "attn.qkv.bias"], 3)
        for n, w, b in zip(("query", "key", "value"), weights, biases):
            a[f"{att}{n}/kernel"], a[f"{att}{n}/bias"] = w.T.reshape(d, h, d // h), b.reshape(h, d // h)
        a[f"{att}out/kernel"] = sd[q + "attn.proj.weight"].T.reshape(h, d // h, d)
        a[f"{att}out/bias"] = sd[q + "attn.proj.bias"]
    np.savez(path, **{k: np.ascontiguousarray(v) for k, v in a.items()})  # row-major, as JAX's arrays are saved
    return path


def numpy_transposed(x) -> torch.Tensor:
    """weights/official.py's `_t` before 2026-11-29: each transposed kernel made contiguous by numpy first."""
    import numpy as np

    return torch.from_numpy(np.ascontiguousarray(np.asarray(x))).float()


def load_as_before(path: Path, module, attribute: str, old) -> torch.nn.Module:
    """vitlab.load of an .npz as it was before 2026-11-29: every member through numpy's reads of 256 KiB, and the
    converter's per-array step `module.attribute` replaced by `old` (which transposed the kernels with numpy before
    the load's own copy)."""
    from vitlab.weights.io import NpzArchive

    kept = NpzArchive._read_stored, getattr(module, attribute)
    NpzArchive._read_stored = lambda *args: None
    setattr(module, attribute, old)
    try:
        return vitlab.load(path)
    finally:
        NpzArchive._read_stored = kept[0]
        setattr(module, attribute, kept[1])


def vitlab_rows(name: str, tmp: Path) -> dict:
    from vitlab.weights import official

    model = vitlab.create_model(name, seed=0)
    folder = vitlab.save(model, tmp / "vitlab")
    npz = official_npz(model, tmp / "official.npz")
    if not torch.equal(vitlab.load(npz).head.weight, model.head.weight):
        raise SystemExit("the official .npz written here does not load back as the model")
    return {"vitlab.load": lambda: vitlab.load(folder),
            "vitlab: build, initialise, copy in (before)": lambda: load_built_first(folder),
            "vitlab.load(official .npz)": lambda: vitlab.load(npz),
            "vitlab.load(official .npz) as before": lambda: load_as_before(npz, official, "_t", numpy_transposed)}


def peer_rows(name: str, tmp: Path) -> dict:
    """timm and Hugging Face loading their own saved files; {} where they are not installed."""
    try:
        import timm
        from safetensors.torch import save_file
        from transformers import ViTConfig, ViTForImageClassification
    except ImportError:
        print("timm or transformers is not installed here: vitlab's rows only (see docs/benchmarks.md for the "
              "peers' environment)")
        return {}
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its bars for saving and loading would fill the table's output
    timm_name = TIMM_NAMES[name]
    timm_file = tmp / "timm.safetensors"
    save_file(timm.create_model(timm_name).state_dict(), str(timm_file))
    cfg = vitlab.get_config(name)
    hf_folder = tmp / "hf"
    ViTForImageClassification(ViTConfig(
        hidden_size=cfg.dim, num_hidden_layers=cfg.depth, num_attention_heads=cfg.heads, intermediate_size=cfg.mlp_dim,
        image_size=cfg.image_size[0], patch_size=cfg.patch_size, num_labels=cfg.num_classes)).save_pretrained(hf_folder)
    return {"timm.create_model(pretrained=True, file=...)": lambda: timm.create_model(
                timm_name, pretrained=True, pretrained_cfg_overlay=dict(file=str(timm_file))).eval(),
            "transformers from_pretrained": lambda: ViTForImageClassification.from_pretrained(hf_folder).eval()}


def time_rows(rows: dict, rounds: int, image: torch.Tensor) -> dict[str, tuple[list[float], list[float]]]:
    """Seconds per load of each row and to its first prediction (load + one image), `rounds` times, the rows in a
    new random order each round."""
    times: dict[str, tuple[list[float], list[float]]] = {label: ([], []) for label in rows}
    order = list(rows)
    for label in order:  # a first load of each (file into the page cache, lazy imports) is not timed
        rows[label]()
    for _ in range(rounds):
        random.shuffle(order)
        for label in order:
            gc.collect()
            start = time.perf_counter()
            model = rows[label]()
            loaded = time.perf_counter()
            with torch.inference_mode():
                model(image)
            times[label][0].append(loaded - start)
            times[label][1].append(time.perf_counter() - start)
            del model
    return times


REWRITE_CHECK = """
import os, sys, torch
kind, path, file = sys.argv[1:4]
if kind == "vitlab":
    import vitlab
    model = vitlab.load(path)
elif kind == "timm":
    import timm
    model = timm.create_model("vit_tiny_patch16_224", pretrained=True, pretrained_cfg_overlay=dict(file=path)).eval()
else:
    from transformers import ViTForImageClassification
    model = ViTForImageClassification.from_pretrained(path).eval()
x = torch.randn(1, 3, 224, 224)
def logits():
    with torch.inference_mode():
        out = model(x)
    return getattr(out, "logits", out).clone()
before = logits()
size = os.path.getsize(file)
with open(file, "r+b") as fh:  # the file written in place, as a save to the same path does
    fh.seek(size // 2)
    fh.write(bytes([0x7F]) * (size // 2 - 8))
print("changed" if not torch.equal(before, logits()) else "unchanged", flush=True)
with open(file, "r+b") as fh:
    fh.truncate(size // 4)
logits()
print("ran", flush=True)
"""


def rewrite_check(tmp: Path) -> None:
    """What a loaded model does when its file is then written in place (a save to the same path) and truncated,
    each library in a process of its own (a memory-mapped file that shrinks kills the process with SIGBUS)."""
    import signal
    import subprocess
    import sys

    vitlab_rows("vit-ti/16", tmp)  # writes the files
    have_peers = bool(peer_rows("vit-ti/16", tmp))
    files = {"vitlab": (tmp / "vitlab", tmp / "vitlab" / "model.safetensors"),
             "timm": (tmp / "timm.safetensors", tmp / "timm.safetensors"),
             "transformers": (tmp / "hf", tmp / "hf" / "model.safetensors")}
    print("\nViT-Ti/16 loaded, then its file written in place (half of it) and truncated (to a quarter):")
    for kind, (path, file) in files.items():
        if kind != "vitlab" and not have_peers:
            continue
        saved = file.read_bytes()
        done = subprocess.run([sys.executable, "-c", REWRITE_CHECK, kind, str(path), str(file)],
                              capture_output=True, text=True)
        file.write_bytes(saved)
        said = done.stdout.split()
        code = done.returncode
        ended = "ran on" if code == 0 else (f"process killed by {signal.Signals(-code).name}" if code < 0
                                            else f"failed (exit {code}): {done.stderr.strip()[-200:]}")
        print(f"  {kind:<13} after the write: logits {said[0] if said else '?'}; after the truncation: {ended}")


def print_table(times: dict[str, tuple[list[float], list[float]]]) -> None:
    """Median and range of each row's load, median of its load + first image, each over the fastest peer's."""
    peers = [t for label, t in times.items() if not label.startswith("vitlab")]
    best = [min(statistics.median(t[i]) for t in peers) if peers else None for i in (0, 1)]
    print(f"  {'row':<52} {'load s':>7} {'range s':>13} {'peer/row':>9} {'+ 1 image s':>12} {'peer/row':>9}")
    for label, (load, first) in times.items():
        ratios = [f"{b / statistics.median(t):.2f}x" if b else "-" for b, t in zip(best, (load, first))]
        print(f"  {label:<52} {statistics.median(load):>7.3f} {min(load):>6.3f}-{max(load):<6.3f} {ratios[0]:>9} "
              f"{statistics.median(first):>12.3f} {ratios[1]:>9}")


def old_fingerprint(model: torch.nn.Module) -> str:
    """engine.choose.fingerprint as it was before 2026-11-29: blake2b over a copy of each tensor's bytes."""
    import hashlib

    h = hashlib.blake2b(digest_size=12)
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def time_digests(rounds: int) -> None:
    """The weights' digest an engine start computes (which artefact folder), old and new, on ViT-B/16."""
    import hashlib

    from vitlab.engine.choose import fingerprint
    from vitlab.engine.digest import WORKERS

    model = vitlab.create_model("vit-b/16", seed=0).eval()
    flat = torch.cat([t.reshape(-1) for t in model.state_dict().values()]).numpy()
    rows = {"blake2b, one thread, copies (fingerprint before)": lambda: old_fingerprint(model),
            f"chunked SHA-256, {WORKERS} threads (fingerprint now)": lambda: fingerprint(model),
            "blake2b of the bytes, one thread": lambda: hashlib.blake2b(flat).digest(),
            "SHA-256 of the bytes, one thread": lambda: hashlib.sha256(flat).digest()}
    times: dict[str, list[float]] = {label: [] for label in rows}
    for _ in range(rounds):
        for label in random.sample(list(rows), len(rows)):
            start = time.perf_counter()
            rows[label]()
            times[label].append(time.perf_counter() - start)
    print(f"\nViT-B/16's weights ({flat.nbytes / 2**20:.0f} MiB) hashed, median of {rounds}:")
    for label, t in times.items():
        print(f"  {label:<52} {statistics.median(t):.3f} s  {flat.nbytes / 2**20 / statistics.median(t):6.0f} MiB/s")


def old_bit_convert(a, key: str, want: tuple[int, ...]) -> torch.Tensor:
    """weights/big_transfer.py's `_convert` before 2026-11-29: the kernels transposed by numpy first."""
    import numpy as np

    if len(want) == 4:
        a = a.transpose(3, 2, 0, 1)
    elif key == "head.weight" and a.ndim == 4:
        a = a.reshape(a.shape[-2], a.shape[-1]).T
    else:
        a = a.reshape(want)
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def bit_rows(name: str, tmp: Path) -> dict:
    """vitlab.load of a big_transfer .npz (BiT's published format), now and as before (numpy's reads and
    transposes)."""
    import numpy as np

    from vitlab.weights import big_transfer

    path = tmp / "bit.npz"
    np.savez(path, **big_transfer.to_big_transfer_arrays(vitlab.create_model(name, seed=0)))
    return {"vitlab.load(big_transfer .npz)": lambda: vitlab.load(path),
            "vitlab.load(big_transfer .npz) as before":
                lambda: load_as_before(path, big_transfer, "_convert", old_bit_convert)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vit-b/16", help="comma-separated: " + ", ".join(TIMM_NAMES))
    parser.add_argument("--rounds", type=int, default=7, help="timed loads of each row (default 7)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rewrite-check", action="store_true",
                        help="also show what each library's loaded model does when its file is rewritten in place")
    parser.add_argument("--bit", default="", help="also a BiT ResNet's big_transfer .npz (e.g. bit-r50x3)")
    parser.add_argument("--digests", action="store_true",
                        help="also time the weights' digest every engine start computes, old and new")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.rounds} interleaved loads; "
          "'+ 1 image': the load and the first prediction at batch 1")
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            rows = vitlab_rows(name, Path(tmp)) | peer_rows(name, Path(tmp))
            times = time_rows(rows, args.rounds, torch.randn(1, 3, 224, 224))
        print(f"\n{name}")
        print_table(times)
    if args.bit:
        with tempfile.TemporaryDirectory() as tmp:
            times = time_rows(bit_rows(args.bit, Path(tmp)), args.rounds, torch.randn(1, 3, 224, 224))
        print(f"\n{args.bit}")
        print_table(times)
    if args.rewrite_check:
        with tempfile.TemporaryDirectory() as tmp:
            rewrite_check(Path(tmp))
    if args.digests:
        time_digests(args.rounds)


if __name__ == "__main__":
    main()
