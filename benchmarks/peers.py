"""vitlab against every peer, in one process: timm, Hugging Face, ONNX Runtime running timm's export (as exported,
and fused by ORT's transformer optimizer), and the peers' own int8 (ORT dynamic quantization of their optimized
exports, the recipe ORT's docs give for transformers), interleaved, with ratios to the best peer.

Needs timm, which cannot be imported with the CPU-only torch wheel: run it in a separate environment
(docs/benchmarks.md, "Against every peer"):

    python3 -m venv /work/peers && /work/peers/bin/pip install torch==2.14.1 torchvision timm transformers onnxruntime onnx
    /work/peers/bin/pip install --no-deps -e .
    /work/peers/bin/python benchmarks/peers.py                                  # Ti/S/B-16, batch 1 and 32
    /work/peers/bin/python benchmarks/peers.py --models vit-s/16 --batches 32 --rounds 9 --out /tmp/peers.json
    /work/peers/bin/python benchmarks/peers.py --models fmnist           # the Fashion-MNIST-size ViT (28 px)
    /work/peers/bin/python benchmarks/peers.py --train fmnist,ti16       # training steps instead (AdamW, fp32)
    /work/peers/bin/python benchmarks/peers.py --train ti16,s16,b16 --train-batches 1,32 --steps 2
    /work/peers/bin/python benchmarks/peers.py --train ti16 --train-variants f-linear,erf   # + vitlab rows: F.linear
                                                          # products; the erf GELU (what the official GELU costs)
    /work/peers/bin/pip install openvino nncf                            # for --openvino all
    /work/peers/bin/python benchmarks/peers.py --models vit-b/16 --batches 32 --openvino all

Rows: `vitlab torch` is eager fp32 with the official numerics (tanh GELU), as `--engine torch` runs it (weights packed
once into oneDNN's layout); `vitlab model(x)` the model called in a user's own code under `torch.inference_mode()`
(the direct operator calls with the live weights, nothing packed; no one-thread rule for small calls); `vitlab onnxruntime` the exact fp32 ORT engine (`--engine onnxruntime`); `vitlab int8
static|dynamic` what `--int8` builds. With `--openvino ours`: `vitlab openvino` (`--engine openvino`, exact fp32) and
`vitlab int8 openvino [bf16]` (OpenVINO's static int8 as `--int8` builds it, the rest in fp32 or bf16); with
`--openvino all` also a peer user's OpenVINO: `timm -> OpenVINO` (fp32), `timm -> OpenVINO (its defaults: bf16)`
(where the CPU has bf16, OpenVINO's default there) and `timm -> OpenVINO int8 (NNCF)` (timm's export quantized by
NNCF with its transformer defaults, run with OpenVINO's defaults). Peers run their defaults (timm: exact GELU). Every call waits 50 ms first: ONNX Runtime's threads spin after a run (its default, kept for
ours and the peers'), and without the pause they took the cores from whichever row ran next (docs/benchmarks.md). "vs best peer" divides by the fastest peer row of the same setting (fp32 rows by the fastest
fp32 peer, bf16 rows by the fastest fp32 or bf16 peer, int8 rows by the fastest peer of all, int8 included). Before each setting is timed every row runs in turn
for at least `--settle-s` seconds: on the VMs measured here the first work of a process runs slow for a while.

`--tune-allocator` first does what every vitlab command on the CPU does (`vitlab.runtime.tune_cpu_allocator`:
glibc keeps freed memory instead of page-faulting activations in on every call); it is process-wide, so the torch
peers run with it too, and ONNX Runtime (its own arena) is unaffected.

`--sub-batches 16,8,4` adds, at each larger batch, every row run in sub-batches of each size (`engine/sub_batch.py`:
what `--engine auto` and `--int8` run where their timing picks it; `--sub-batch-int8-only` for the int8 rows only):
every row is then divided by the fastest peer as the peers run (whole batches), and also by the fastest peer given
the same sub-batches.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

import vitlab
from vitlab.engine.choose import PAUSE_S
from vitlab.engine.ort import OrtEngine, build_fp32, build_int8_dynamic, flops_per_image
from vitlab.engine.static_int8 import build_int8_static
from vitlab.engine.sub_batch import SubBatched
from vitlab.engine.torch_engines import TorchEngine

TIMM_NAMES = {"vit-ti/16": "vit_tiny_patch16_224", "vit-s/16": "vit_small_patch16_224",
              "vit-b/16": "vit_base_patch16_224", "vit-b/32": "vit_base_patch32_224"}
# `--models fmnist`: the Fashion-MNIST-size ViT of the issue (the training size "fmnist" below, 10 classes)
FMNIST = dict(image_size=28, in_chans=1, patch_size=4, dim=64, depth=6, heads=4, mlp_dim=128, num_classes=10)
IMAGE = {"fmnist": (FMNIST["in_chans"], FMNIST["image_size"], FMNIST["image_size"])}  # (3, 224, 224) otherwise


def image_hw(cfg) -> tuple[int, int]:
    """(height, width) of the images a vitlab config is made for."""
    return tuple(g * cfg.patch_size for g in cfg.grid_size)


def timm_vit(cfg):
    """timm's VisionTransformer (its defaults: exact GELU) in the shape of a vitlab config."""
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=cfg.image_size, patch_size=cfg.patch_size, in_chans=cfg.in_chans,
                             num_classes=cfg.num_classes, embed_dim=cfg.dim, depth=cfg.depth, num_heads=cfg.heads,
                             mlp_ratio=cfg.mlp_dim / cfg.dim)


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Non-degenerate weights (zero-initialised heads and biases quantize to nothing): same speed, real ranges."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


class Torch:
    def __init__(self, model, bf16: bool = False):
        self.model, self.bf16 = model.eval(), bf16

    def __call__(self, x):
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        with torch.inference_mode(), ctx:
            out = self.model(x)
        return out.logits if hasattr(out, "logits") else out


def export_plain(model, path: Path, in_chans: int = 3, size: tuple[int, int] = (224, 224)) -> Path:
    """A peer's export as its users make it: torch.onnx.export with the TorchScript exporter, dynamic batch."""
    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            out = self.m(x)
            return out.logits if hasattr(out, "logits") else out

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(Logits(model).eval(), (torch.zeros(1, in_chans, *size),), str(path),
                          input_names=["images"], output_names=["logits"], opset_version=17, dynamo=False,
                          dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}})
    return path


def optimized(path: Path, heads: int, dim: int) -> Path:
    from onnxruntime.transformers.optimizer import optimize_model

    out = path.with_name(path.stem + ".opt.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimize_model(str(path), model_type="vit", num_heads=heads, hidden_size=dim, opt_level=0).save_model_to_file(str(out))
    return out


def peer_int8(path: Path, out: Path) -> Path:
    """A peer user's int8: ORT's dynamic quantization with its defaults (int8 weights, every supported op)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_dynamic(str(path), str(out), weight_type=QuantType.QInt8,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    return out


def hf_model(cfg):
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        hidden_size=cfg.dim, num_hidden_layers=cfg.depth, num_attention_heads=cfg.heads,
        intermediate_size=cfg.mlp_dim, image_size=cfg.image_size, patch_size=cfg.patch_size,
        num_channels=cfg.in_chans, num_labels=cfg.num_classes,
        layer_norm_eps=cfg.layer_norm_eps, attn_implementation="sdpa"))


def openvino_rows(ours, fp32_onnx_timm: Path, tmp: Path, threads: int, calibration,
                  peers: bool) -> dict[str, tuple[str, object]]:
    """vitlab's OpenVINO engines (fp32; static int8 with the rest in fp32 and, where the CPU has it, bf16), and with
    `peers` a peer user's OpenVINO: timm's export in fp32, and quantized by NNCF (OpenVINO's own post-training
    quantizer, its defaults for transformers, the same calibration images) run with OpenVINO's defaults (bf16 for
    the rest where the CPU has it)."""
    from vitlab.engine.openvino import OvEngine, bf16_supported, build_fp32_ir, build_int8_ir, core

    ir = build_fp32_ir(ours, tmp / "vitlab-ov", image_hw(ours.config))
    int8_ir = build_int8_ir(ir, tmp / "vitlab-ov" / "int8.xml", calibration, threads)
    rows = {"vitlab openvino": ("ours", OvEngine(ir, threads)),
            "vitlab int8 openvino": ("ours-int8", OvEngine(int8_ir, threads, exact=False))}
    if bf16_supported():
        rows["vitlab int8 openvino bf16"] = ("ours-int8", OvEngine(int8_ir, threads, exact=False, precision="bf16"))
    if peers:
        import nncf
        import openvino as ov

        rows["timm -> OpenVINO"] = ("peer", OvEngine(fp32_onnx_timm, threads))
        if bf16_supported():
            # What a peer user gets unasked: on a CPU with bf16 OpenVINO runs the fp32 model in bf16 by default. Not an
            # fp32 row (its logits are bf16's), but a peer path that our bf16 and int8 rows must be divided by too;
            # until 2026-11-27 only the f32-hinted row above was timed, so it was missing from "every peer".
            rows["timm -> OpenVINO (its defaults: bf16)"] = ("peer-bf16", OvEngine(fp32_onnx_timm, threads, exact=False,
                                                                                   precision=None))
        quantized = nncf.quantize(core().read_model(str(fp32_onnx_timm)), nncf.Dataset(calibration),
                                  model_type=nncf.ModelType.TRANSFORMER, subset_size=sum(map(len, calibration)))
        ov.save_model(quantized, str(tmp / "timm-nncf.xml"), compress_to_fp16=False)
        # as a peer user runs it: OpenVINO's defaults, only the threads and the latency hint set
        rows["timm -> OpenVINO int8 (NNCF)"] = ("peer-int8", OvEngine(tmp / "timm-nncf.xml", threads, exact=False,
                                                                      precision=None))
    return rows


def candidates(name: str, tmp: Path, threads: int, bf16: bool, peers_int8: bool,
               openvino: str = "") -> dict[str, tuple[str, object]]:
    """label -> (kind, engine); kind is 'ours' or 'peer', with '-int8' for int8 rows. `openvino`: "" (none),
    "ours" (vitlab's OpenVINO engines) or "all" (also the peers' OpenVINO paths)."""
    import timm

    if name == "fmnist":  # the Fashion-MNIST-size ViT (28 px, 1 channel, 10 classes), timm built to the same shape
        ours = perturbed(vitlab.create_model("custom", **FMNIST))
        cfg = ours.config
        timm_model = perturbed(timm_vit(cfg))
    else:
        ours = perturbed(vitlab.create_model(name, num_classes=1000))
        cfg = ours.config
        timm_model = perturbed(timm.create_model(TIMM_NAMES[name], pretrained=False))
    size, chans = image_hw(cfg), cfg.in_chans
    hf = perturbed(hf_model(cfg))
    rows: dict[str, tuple[str, object]] = {
        "vitlab torch": ("ours", TorchEngine(ours)),  # what `--engine torch` runs (weights packed once)
        "vitlab model(x)": ("ours", Torch(ours)),  # what a user's own `model(x)` under inference_mode runs
        "timm torch": ("peer", Torch(timm_model)),
        "HF torch": ("peer", Torch(hf)),
    }
    if bf16:
        rows["vitlab torch bf16"] = ("ours-bf16", Torch(ours, True))
        rows["timm torch bf16"] = ("peer-bf16", Torch(timm_model, True))
    fp32 = build_fp32(ours, tmp / "vitlab", size)
    # as `--engine onnxruntime` and `--int8` run them: a call with little arithmetic on one thread (ort.py)
    flops = flops_per_image(ours, size)
    rows["vitlab onnxruntime"] = ("ours", OrtEngine(fp32, threads, flops_per_image=flops))
    rng = np.random.RandomState(0)
    calibration = [rng.randn(16, chans, *size).astype(np.float32) for _ in range(4)]
    rows["vitlab int8 static"] = ("ours-int8", OrtEngine(
        build_int8_static(fp32, tmp / "vitlab/int8-static.onnx", calibration), threads, flops_per_image=flops))
    rows["vitlab int8 dynamic"] = ("ours-int8", OrtEngine(
        build_int8_dynamic(fp32, tmp / "vitlab/int8-dynamic.onnx"), threads, flops_per_image=flops))
    timm_onnx = export_plain(timm_model, tmp / "timm.onnx", chans, size)
    timm_opt = optimized(timm_onnx, cfg.heads, cfg.dim)
    rows["timm -> ORT"] = ("peer", OrtEngine(timm_onnx, threads))
    rows["timm -> ORT optimized"] = ("peer", OrtEngine(timm_opt, threads))
    if openvino:
        rows.update(openvino_rows(ours, timm_onnx, tmp, threads, calibration, openvino == "all"))
    if peers_int8:
        rows["timm -> ORT int8 dynamic (as exported)"] = ("peer-int8", OrtEngine(
            peer_int8(timm_onnx, tmp / "timm.plain.int8.onnx"), threads))
        rows["timm -> ORT int8 dynamic"] = ("peer-int8", OrtEngine(peer_int8(timm_opt, tmp / "timm.int8.onnx"),
                                                                   threads))
        hf_opt = optimized(export_plain(hf, tmp / "hf.onnx", chans, size), cfg.heads, cfg.dim)
        rows["HF -> ORT int8 dynamic"] = ("peer-int8", OrtEngine(peer_int8(hf_opt, tmp / "hf.int8.onnx"),
                                                                 threads))
    return rows


def round_orders(labels: list[str], rounds: int, seed: int | str = 0) -> list[str]:
    """Every label once per round, each round in a new random order (seeded): what a row follows changes from round
    to round. A row that runs right after an ONNX Runtime row runs slower on the VMs measured here, even after the
    pause. The earlier rotation (A B C, B C A, ...) kept each row behind the same neighbour in almost every round:
    with the rows in their listed order, `vitlab torch` followed the last row (an ORT one) in every round where it
    did not run first."""
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        order = list(labels)
        rng.shuffle(order)
        out += order
    return out


def order_seed(base: int, name: str, batch: int, repeat: int) -> str:
    """The row-order seed of one timed setting. Until 2026-11-27 every setting and every repeat took seed 0, so all
    of them (and every rerun of a command) timed the very same sequence of orders: whatever that one sequence did to a
    row was never averaged out. With the 8 rows of `--no-peer-int8` it put `vitlab torch` right after an ORT row
    less often than timm's and HF's torch rows (3 of 5 rounds against 4 of 5; 6 of 9 against 8 and 7; 14 of 21
    against 16 and 16), in every setting and repeat alike, while a torch row after an ORT row runs slower on the VMs
    measured (docs/benchmarks.md, "Row order"). Now each setting and repeat has its own order (still seeded:
    `--order-seed` picks another set for an independent rerun)."""
    return f"{base}|{name}|{batch}|{repeat}"


def measure(rows: dict, batch: int, rounds: int, settle_s: float = 0.0,
            image: tuple[int, int, int] = (3, 224, 224), seed: int | str = 0,
            back_to_back: int = 0) -> dict[str, float]:
    """images/s per row: one call after the pause in each round, or with `back_to_back` N, one untimed call after
    the pause and then N calls in a row, timed together (a timeit-style loop, as a user's own benchmark runs)."""
    x = torch.randn(batch, *image)
    start = time.perf_counter()
    while True:  # warm-up: every row at least once, in turn until settle_s has passed (the VM's first work runs slow)
        for _, engine in rows.values():
            engine(x)
        if time.perf_counter() - start >= settle_s:
            break
    times = {label: [] for label in rows}
    for label in round_orders(list(rows), rounds, seed):
        time.sleep(PAUSE_S)
        engine = rows[label][1]
        if back_to_back:
            engine(x)
        t = time.perf_counter()
        for _ in range(max(back_to_back, 1)):
            engine(x)
        times[label].append((time.perf_counter() - t) / max(back_to_back, 1))
    return {label: batch / statistics.median(ts) for label, ts in times.items()}


SUB = " [sub-batches of "


def with_sub_batches(rows: dict, batch: int, sizes: list[int], int8_only: bool = False) -> dict:
    """`rows` plus each row (each int8 row with `int8_only`) run in sub-batches of each size below `batch`."""
    extra = {f"{label}{SUB}{s}]": (kind, SubBatched(engine, s))
             for s in sizes if s < batch for label, (kind, engine) in rows.items()
             if kind.endswith("int8") or not int8_only}
    return {**rows, **extra}


def precision_of(kind: str) -> str:
    """'fp32', 'bf16' or 'int8' from a row's kind ('ours', 'peer-bf16', 'ours-int8', ...)."""
    return kind.partition("-")[2] or "fp32"


# The peer kinds each precision class is divided by: fp32 rows by fp32 peers only, bf16 rows by the fp32 and bf16
# peers (until 2026-11-27 `vitlab torch bf16` was divided by the fp32 peers alone, leaving out `timm torch bf16`:
# a bf16 row of ours against fp32 peers), int8 rows by every peer, int8 included.
BASES = {"fp32": {"peer"}, "bf16": {"peer", "peer-bf16"}, "int8": {"peer", "peer-bf16", "peer-int8"}}
BASE_NAMES = {"fp32": "fp32 peer", "bf16": "peer (bf16 incl.)", "int8": "peer (int8 incl.)"}


def report(name: str, batch: int, rows: dict, speeds: dict[str, float]) -> list[dict]:
    """Ratios to the fastest peer as the peers run (whole batches), and where sub-batched rows were timed, also to
    the fastest peer given the same sub-batches."""
    kinds = {label: kind for label, (kind, _) in rows.items()}

    def best(precision: str, sub_batched: bool) -> float:
        return max(v for k, v in speeds.items() if kinds[k] in BASES[precision] and (sub_batched or SUB not in k))

    any_sub = any(SUB in k for k in speeds)
    out = []
    for label, v in sorted(speeds.items(), key=lambda kv: -kv[1]):
        precision = precision_of(kinds[label])
        base, base_sub = best(precision, False), best(precision, True)
        out.append({"model": name, "batch": batch, "engine": label, "kind": kinds[label],
                    "images_per_s": round(v, 2), "vs_best_peer": round(v / base, 3)}
                   | ({"vs_best_peer_sub_batched_too": round(v / base_sub, 3)} if any_sub else {}))
        print(f"{name:10s} {batch:3d}  {label:58s} {v:8.2f} img/s   x{v / base:.2f} vs best "
              f"{BASE_NAMES[precision]}"
              + (f"   x{v / base_sub:.2f} vs the same with sub-batches" if any_sub else ""))
    return out


def repeat_ratios(name: str, batch: int, rows: dict, runs: list[dict[str, float]]) -> list[dict]:
    """Each of our fp32 rows against the fastest fp32 peer of the same repeat, repeat by repeat."""
    out = []
    peers_ = [label for label, (kind, _) in rows.items() if kind == "peer"]
    for label in (label for label, (kind, _) in rows.items() if kind == "ours"):
        ours, best = [run[label] for run in runs], [max(run[p] for p in peers_) for run in runs]
        ratios = [o / b for o, b in zip(ours, best)]
        out.append({"model": name, "batch": batch, "engine": label, "vs_best_peer_each_repeat": ratios,
                    "images_per_s_each_repeat": ours, "best_peer_images_per_s_each_repeat": best})
        print(f"{name:10s} {batch:3d}  {label} vs best fp32 peer, each repeat: "
              + " ".join(f"{r:.2f}" for r in ratios) + f"  (median {statistics.median(ratios):.2f})")
    return out


def each_repeat(name: str, batch: int, runs: list[dict[str, float]]) -> list[dict]:
    """Each row's images/s in each repeat (for rows timed without a peer, `--rows`)."""
    out = []
    for label in runs[0]:
        speeds = [run[label] for run in runs]
        out.append({"model": name, "batch": batch, "engine": label, "images_per_s_each_repeat": speeds})
        print(f"{name:10s} {batch:3d}  {label} images/s, each repeat: " + " ".join(f"{v:.1f}" for v in speeds)
              + f"  (median {statistics.median(speeds):.1f})")
    return out


# training sizes: name -> (image size, channels, patch, dim, depth, heads, mlp, batch)
TRAIN_SIZES = {"fmnist": (28, 1, 4, 64, 6, 4, 128, 128), "ti16": (224, 3, 16, 192, 12, 3, 768, 16),
               "s16": (224, 3, 16, 384, 12, 6, 1536, 32), "b16": (224, 3, 16, 768, 12, 12, 3072, 32)}


def train_models(size, erf_row: bool = False) -> dict[str, torch.nn.Module]:
    """vitlab (official numerics: tanh GELU), timm and HF with their own defaults (exact GELU), same shapes; with
    `erf_row` also vitlab with the erf GELU (not the official function: what the official one costs)."""
    from transformers import ViTConfig, ViTForImageClassification

    img, ch, p, d, depth, heads, mlp, _ = size
    shape = dict(num_classes=10, image_size=img, in_chans=ch, patch_size=p, dim=d, depth=depth, heads=heads,
                 mlp_dim=mlp, seed=0)
    ours = vitlab.create_model("custom", **shape)
    timm_model = timm_vit(ours.config)
    hf = ViTForImageClassification(ViTConfig(hidden_size=d, num_hidden_layers=depth, num_attention_heads=heads,
                                             intermediate_size=mlp, image_size=img, patch_size=p, num_channels=ch,
                                             num_labels=10, attn_implementation="sdpa"))
    models = {"vitlab": ours, "timm": timm_model, "HF": hf}
    if erf_row:
        models["vitlab erf GELU"] = vitlab.create_model("custom", gelu="exact", **shape)
    return models


def train_step(model, x, y):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()

    def step():
        out = model(x)
        logits = out.logits if hasattr(out, "logits") else out
        loss = torch.nn.functional.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return step


def with_products(step, onednn: bool):
    """`step` with vitlab's linear layers through oneDNN (its route) or torch's F.linear, restored after."""
    from vitlab.models import fast_linear

    def run():
        before, fast_linear.ONEDNN_LINEAR = fast_linear.ONEDNN_LINEAR, onednn
        try:
            step()
        finally:
            fast_linear.ONEDNN_LINEAR = before
    return run


def bench_training(name: str, rounds: int, steps: int, batch: int | None = None, seed: int = 0,
                   variants: tuple[str, ...] = ()) -> list[dict]:
    """Images/s of training steps; `variants` adds vitlab rows: "f-linear" (its products through F.linear) and
    "erf" (the erf GELU instead of the official tanh one). The best peer is the best of timm and HF."""
    size = TRAIN_SIZES[name]
    img, ch, batch = size[0], size[1], batch or size[7]
    torch.manual_seed(0)
    x, y = torch.randn(batch, ch, img, img), torch.randint(0, 10, (batch,))
    models = train_models(size, erf_row="erf" in variants)
    fns = {label: train_step(m, x, y) for label, m in models.items()}
    if "f-linear" in variants:
        fns["vitlab F.linear"] = with_products(train_step(models["vitlab"], x, y), onednn=False)
    for fn in fns.values():
        fn()
    # a training loop of one's own, as here, takes the route `vitlab train --products auto` takes (fast_linear "auto")
    route = models["vitlab"].__dict__.get("_products_route", "onednn")
    print(f"train {name:7s} batch {batch:3d}  vitlab's training products: {route} (measured at its first step)")
    times = {label: [] for label in fns}
    for label in round_orders(list(fns), rounds, order_seed(seed, f"train {name}", batch, 0)):
        t = time.perf_counter()
        for _ in range(steps):
            fns[label]()
        times[label].append((time.perf_counter() - t) / steps)
    speeds = {label: batch / statistics.median(ts) for label, ts in times.items()}
    best_peer = max(v for k, v in speeds.items() if not k.startswith("vitlab"))
    out = []
    for label, v in sorted(speeds.items(), key=lambda kv: -kv[1]):
        print(f"train {name:7s} batch {batch:3d}  {label:15s} {v:8.1f} img/s   x{v / best_peer:.2f} vs best peer")
        out.append({"train": name, "batch": batch, "model": label, "images_per_s": round(v, 2),
                    "vs_best_peer": round(v / best_peer, 3)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="vit-ti/16,vit-s/16,vit-b/16",
                    help="comma-separated: vit-ti/16, vit-s/16, vit-b/16, vit-b/32, or fmnist (the 28 px Fashion-MNIST ViT)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--bf16", action="store_true", help="also bf16 autocast rows for vitlab and timm")
    ap.add_argument("--no-peer-int8", action="store_true", help="leave out the peers' int8 rows (faster set-up)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--train", default=None, help="time training steps for these sizes (fmnist,ti16,s16,b16) instead")
    ap.add_argument("--steps", type=int, default=3, help="training steps per round (with --train)")
    ap.add_argument("--train-batches", default="",
                    help="with --train: these batch sizes (comma-separated) instead of each size's own")
    ap.add_argument("--sub-batches", default="",
                    help="also time every row in sub-batches of these sizes (comma-separated), at larger batches")
    ap.add_argument("--sub-batch-int8-only", action="store_true", help="sub-batches for the int8 rows only")
    ap.add_argument("--tune-allocator", action="store_true",
                    help="raise glibc's mmap/trim thresholds first, as every vitlab command on the CPU does "
                         "(process-wide: the torch peers run with it too)")
    ap.add_argument("--openvino", choices=["ours", "all"], default=None,
                    help="also vitlab's OpenVINO engines (ours), and the peers' OpenVINO paths: timm's export in "
                         "OpenVINO fp32 and quantized by NNCF (all; needs pip install openvino nncf)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="time every setting this many times in a row (rounds each, one warm-up before the first) "
                         "and report each row's median; prints each repeat's ratio of our fp32 rows to the best peer "
                         "(how far the VM moves a ratio between measurements)")
    ap.add_argument("--rows", default="",
                    help="time only these rows (labels as printed, separated by ';'), e.g. 'vitlab torch' alone")
    ap.add_argument("--back-to-back", type=int, default=0, metavar="N",
                    help="time N calls in a row per row and round (after one untimed call), as a timeit-style loop "
                         "does, instead of one call after the 50 ms pause")
    ap.add_argument("--order-seed", type=int, default=0,
                    help="seed of the rows' random order (each setting and repeat draws its own from it); another "
                         "value gives an independent rerun of the same command")
    ap.add_argument("--settle-s", type=float, default=20.0,
                    help="warm up by calling every row in turn for at least this long before each setting is timed")
    ap.add_argument("--train-variants", default="",
                    help="with --train: extra vitlab rows, comma-separated: f-linear (its products through F.linear), "
                         "erf (the erf GELU, not the official function: what the official one costs)")
    ap.add_argument("--vitlab-f-linear", action="store_true",
                    help="vitlab's linear layers through torch's F.linear instead of its oneDNN route "
                         "(models/fast_linear.py), to time that route against the peers")
    args = ap.parse_args()
    unknown = {v for v in args.train_variants.split(",") if v} - {"f-linear", "erf"}
    if unknown:
        ap.error(f"--train-variants takes f-linear and erf, not {', '.join(sorted(unknown))}")
    torch.set_num_threads(args.threads)
    if args.vitlab_f_linear:
        import vitlab.models.fast_linear as fast_linear

        fast_linear.ONEDNN_LINEAR = False
    if args.tune_allocator:
        from vitlab.runtime import tune_cpu_allocator

        args.tune_allocator = tune_cpu_allocator()
    import onnxruntime
    import timm
    import transformers

    from vitlab.engine.openvino import openvino_version

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, threads {args.threads}; "
          f"torch {torch.__version__}, timm {timm.__version__}, transformers {transformers.__version__}, "
          f"onnxruntime {onnxruntime.__version__}; openvino {openvino_version()}; load average {os.getloadavg()[0]:.2f}; "
          f"allocator {'tuned (freed memory kept, every row)' if args.tune_allocator else 'as it comes'}"
          f"{'; vitlab linear layers through F.linear' if args.vitlab_f_linear else ''}")
    results = []
    if args.train:
        for name in args.train.split(","):
            for batch in ([int(b) for b in args.train_batches.split(",")] if args.train_batches else [None]):
                results += bench_training(name, args.rounds, args.steps, batch, args.order_seed,
                                          tuple(v for v in args.train_variants.split(",") if v))
    for name in ([] if args.train else args.models.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            rows = candidates(name, Path(tmp), args.threads, args.bf16, not args.no_peer_int8, args.openvino or "")
            if args.rows:
                rows = {label: rows[label] for label in args.rows.split(";")}
            sizes = [int(s) for s in args.sub_batches.split(",") if s]
            for batch in (int(b) for b in args.batches.split(",")):
                timed = with_sub_batches(rows, batch, sizes, args.sub_batch_int8_only)
                runs = [measure(timed, batch, args.rounds, args.settle_s if i == 0 else 0.0,
                                IMAGE.get(name, (3, 224, 224)), order_seed(args.order_seed, name, batch, i),
                                args.back_to_back)
                        for i in range(args.repeats)]
                speeds = {label: statistics.median(run[label] for run in runs) for label in timed}
                if any(kind == "peer" for kind, _ in timed.values()):
                    results += report(name, batch, timed, speeds)
                else:  # no peer to divide by: each row's images/s, repeat by repeat
                    results += each_repeat(name, batch, runs)
                if args.repeats > 1 and any(kind == "peer" for kind, _ in timed.values()):
                    results += repeat_ratios(name, batch, timed, runs)
    if args.out:
        Path(args.out).write_text(json.dumps({"load_average_end": os.getloadavg()[0], "order_seed": args.order_seed,
                                              "rows": results}, indent=1))


if __name__ == "__main__":
    main()
