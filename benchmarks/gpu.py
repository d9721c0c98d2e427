"""vitlab against timm and Hugging Face on a CUDA GPU, in one process: ViT-B/16 training steps (bf16 autocast,
AdamW) and inference images/s, with the model FLOPs utilisation (MFU).

    python benchmarks/gpu.py                                   # ViT-B/16, batch 256, eager
    python benchmarks/gpu.py --compile --out /tmp/gpu.json     # torch.compile rows too (+ compile time)
    python benchmarks/gpu.py --device cpu --model vit-ti/16 --batch 8 --rounds 1 --steps 1   # a smoke run

Every row gets the same random images already on the device (no data loading), the same loss (cross entropy
over 1000 classes), torch's fused AdamW and bf16 autocast; timm and HF run their defaults (exact GELU), vitlab the
official numerics (tanh GELU). Rounds are interleaved (each row in turn, `--rounds` times); a round times
`--steps` steps between CUDA synchronisations; the median round is reported.

MFU = images/s x the model's FLOPs per image / the GPU's peak bf16 rate. The FLOPs are the model's full count:
2 x its multiply-accumulates (`vitlab.models.registry.analytic_macs`: 17.56 G for ViT-B/16, the paper's and timm's
figure, so 35.13 GFLOP forward; a training step counts 3x forward), the same for every row. vitlab computes the
last block for the class token alone (models/vit.py), about 6 % less work than that count: its MFU credits the
model, not the kernels. torch's FlopCounterMode, also printed, leaves out the fused CPU attention kernel (33.70 G
on ViT-B/16), which understated the MFU of the first runs by 4 % (docs/benchmarks.md, "GPU"). `--peak-tflops`
defaults to the H100/H200 SXM datasheet's dense bf16 rate (989.4); the run also measures a bf16 8192^3 matrix
product as a reachable ceiling.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import vitlab
from vitlab.models.registry import analytic_macs

TIMM_NAMES = {"vit-ti/16": "vit_tiny_patch16_224", "vit-s/16": "vit_small_patch16_224",
              "vit-b/16": "vit_base_patch16_224", "vit-l/16": "vit_large_patch16_224"}
HF_SIZES = {"vit-ti/16": (192, 12, 3), "vit-s/16": (384, 12, 6), "vit-b/16": (768, 12, 12), "vit-l/16": (1024, 24, 16)}


def peers(name: str) -> dict[str, torch.nn.Module]:
    """The same architecture from each library, 1000 classes, random weights."""
    rows = {"vitlab": vitlab.create_model(name, num_classes=1000)}
    try:
        import timm

        rows["timm"] = timm.create_model(TIMM_NAMES[name], pretrained=False, num_classes=1000)
    except ImportError:
        print("timm not installed: its rows are left out")
    try:
        from transformers import ViTConfig, ViTForImageClassification

        dim, depth, heads = HF_SIZES[name]
        cfg = ViTConfig(hidden_size=dim, num_hidden_layers=depth, num_attention_heads=heads,
                        intermediate_size=4 * dim, num_labels=1000, attn_implementation="sdpa")
        rows["hf"] = ViTForImageClassification(cfg)
    except ImportError:
        print("transformers not installed: its rows are left out")
    return rows


def logits_of(out):
    return out.logits if hasattr(out, "logits") else out


class TrainStep:
    """One optimizer step: bf16 autocast forward, fp32 loss, backward, fused AdamW."""

    def __init__(self, model, device, compile_: bool):
        self.model = model.to(device).train()
        self.run = torch.compile(self.model) if compile_ else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.type == "cuda")
        self.device = device

    def __call__(self, x, y):
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            out = logits_of(self.run(x))
        F.cross_entropy(out.float(), y).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class Infer:
    def __init__(self, model, device, compile_: bool):
        self.model = model.to(device).eval()
        self.run = torch.compile(self.model) if compile_ else self.model
        self.device = device

    def __call__(self, x, y):
        with torch.inference_mode(), torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits_of(self.run(x))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_flops(model: torch.nn.Module, image_size: int) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    model = model.eval()
    x = torch.randn(1, 3, image_size, image_size, device=next(model.parameters()).device)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(x)
    return counter.get_total_flops()


def matmul_tflops(device, n: int = 8192, reps: int = 10) -> float | None:
    if device.type != "cuda":
        return None
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e12


def time_rows(rows: dict, x, y, rounds: int, steps: int, warmup: int, device) -> dict[str, list[float]]:
    """Images/s of each row per round, rounds interleaved across rows."""
    for fn in rows.values():
        for _ in range(warmup):
            fn(x, y)
    sync(device)
    speeds = {k: [] for k in rows}
    for _ in range(rounds):
        for name, fn in rows.items():
            sync(device)
            t = time.perf_counter()
            for _ in range(steps):
                fn(x, y)
            sync(device)
            speeds[name].append(steps * x.shape[0] / (time.perf_counter() - t))
    return speeds


def peak_memory_gib(fn, x, y, device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    fn(x, y)
    sync(device)
    return torch.cuda.max_memory_allocated(device) / 2 ** 30


def build(kind, models, device, compile_, x, y):
    """Row name -> callable; compiled rows are compiled (first calls) here, and the seconds that took kept."""
    cls = TrainStep if kind == "train" else Infer
    rows, compile_s = {}, {}
    for name, model in models.items():
        rows[name] = cls(model, device, False)
        # Every library compiled, HF included: until 2026-11-27 HF had no compiled row, so "compiled vs compiled"
        # divided vitlab by timm's compiled row alone, not by the fastest compiled peer. A compile that fails is
        # said and its row left out (a lent GPU's minutes are not lost to one library's compiler error).
        if compile_:
            t = time.perf_counter()
            try:
                fn = cls(model, device, True)
                fn(x, y)
                fn(x, y)
                sync(device)
            except Exception as exc:  # noqa: BLE001  (Inductor/dynamo raise many kinds)
                print(f"{name} compiled: left out, torch.compile failed: {type(exc).__name__}: {exc}".splitlines()[0])
                continue
            rows[f"{name} compiled"] = fn
            compile_s[f"{name} compiled"] = time.perf_counter() - t
    return rows, compile_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="vit-b/16", choices=sorted(TIMM_NAMES))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--infer-batch", type=int, default=None, help="inference batch (default: --batch)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="steps timed per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also torch.compile'd rows of every library")
    ap.add_argument("--modes", default="train,infer")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--peak-tflops", type=float, default=989.4, help="the GPU's dense bf16 peak (datasheet)")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 leftovers outside autocast (the loss) as the peers' users run them
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    ceiling = matmul_tflops(device)
    print(f"device: {gpu}; torch {torch.__version__}; model {args.model}; batch {args.batch}; peak "
          f"{args.peak_tflops} TFLOP/s (datasheet)" + (f", bf16 8192^3 matmul measured {ceiling:.0f} TFLOP/s"
                                                      if ceiling else ""))
    models = peers(args.model)
    image_size = 224
    fwd = 2 * analytic_macs(models["vitlab"].config)
    own = {name: forward_flops(m, image_size) for name, m in models.items()}
    print(f"FLOPs per image, forward: model {fwd / 1e9:.2f} G (2 x multiply-accumulates, attention included); "
          "FlopCounterMode on each row (CPU: without the fused attention kernel): "
          + ", ".join(f"{k} {v / 1e9:.2f} G" for k, v in own.items()))
    results = {"device": gpu, "torch": torch.__version__, "model": args.model, "batch": args.batch,
               "peak_tflops": args.peak_tflops, "matmul_tflops": ceiling, "forward_flops": fwd,
               "row_forward_flops": own, "modes": {}}
    for kind in args.modes.split(","):
        batch = args.batch if kind == "train" else (args.infer_batch or args.batch)
        x = torch.randn(batch, 3, image_size, image_size, device=device)
        y = torch.randint(0, 1000, (batch,), device=device)
        rows, compile_s = build(kind, models, device, args.compile, x, y)
        memory = {k: peak_memory_gib(fn, x, y, device) for k, fn in rows.items()}
        speeds = time_rows(rows, x, y, args.rounds, args.steps, args.warmup, device)
        per_image = fwd * (3 if kind == "train" else 1)
        # the fastest peer row of the same mode (compiled ones included); none when no peer is installed
        best_peer = max((statistics.median(v) for k, v in speeds.items() if not k.startswith("vitlab")), default=None)
        print(f"\n{kind} (bf16 autocast, batch {batch}): images/s median of {args.rounds} rounds x {args.steps} steps")
        print(f"{'row':<18}{'images/s':>10}{'vs best peer':>14}{'MFU':>8}{'peak GiB':>10}  rounds")
        table = {}
        for k, v in speeds.items():
            med = statistics.median(v)
            mfu = med * per_image / (args.peak_tflops * 1e12)
            ratio = med / best_peer if best_peer else None
            table[k] = {"images_per_s": med, "rounds": v, "vs_best_peer": ratio, "mfu": mfu,
                        "peak_memory_gib": memory[k], "compile_s": compile_s.get(k)}
            mem = f"{memory[k]:.1f}" if memory[k] is not None else "-"
            extra = f" (compiled in {compile_s[k]:.0f} s)" if k in compile_s else ""
            print(f"{k:<18}{med:>10.1f}{f'{ratio:.3f}' if ratio else '-':>14}{mfu:>8.1%}{mem:>10}  "
                  + " ".join(f"{s:.0f}" for s in v) + extra)
        results["modes"][kind] = {"batch": batch, "rows": table}
        del rows
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
