"""Inference images/s: vitlab vs Hugging Face transformers' ViTForImageClassification, same run.

    python benchmarks/inference.py                      # Ti/16, S/16, B/16; batch 1 and 32; fp32 and bf16
    python benchmarks/inference.py --models vit-ti/16 --batches 1 --reps 5

Both models get the same architecture and numerics (224 px, 1000 classes, same GELU) and run under `torch.inference_mode`;
bf16 means `torch.autocast(dtype=torch.bfloat16)` for both. Timings alternate between the two
models (A, B, B, A, A, B, ...) so that background load hits both alike; the median of the repetitions
is reported, and the ratio vitlab / HF (> 1 means vitlab is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time

import torch

import vitlab


def hf_model(cfg: vitlab.ViTConfig) -> torch.nn.Module:
    from transformers import ViTConfig as HFConfig
    from transformers import ViTForImageClassification

    hf_cfg = HFConfig(
        hidden_size=cfg.dim, num_hidden_layers=cfg.depth, num_attention_heads=cfg.heads,
        intermediate_size=cfg.mlp_dim, image_size=cfg.image_size[0], patch_size=cfg.patch_size,
        num_labels=cfg.num_classes, layer_norm_eps=cfg.layer_norm_eps, attn_implementation="sdpa",
        hidden_act="gelu_pytorch_tanh" if cfg.gelu == "tanh" else "gelu",
    )
    return ViTForImageClassification(hf_cfg).eval()


def time_once(model: torch.nn.Module, x: torch.Tensor, bf16: bool) -> float:
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with torch.inference_mode(), ctx:
        start = time.perf_counter()
        model(x)
        return time.perf_counter() - start


def bench(name: str, batch: int, bf16: bool, reps: int, gelu: str) -> dict:
    torch.manual_seed(0)
    ours = vitlab.create_model(name, gelu=gelu).eval()
    theirs = hf_model(ours.config)
    x = torch.randn(batch, 3, 224, 224)
    for m in (ours, theirs):  # warm-up
        time_once(m, x, bf16)
    t_ours, t_theirs = [], []
    for rep in range(reps):  # alternate which model goes first, so neither always follows the other
        if rep % 2:
            t_theirs.append(time_once(theirs, x, bf16))
            t_ours.append(time_once(ours, x, bf16))
        else:
            t_ours.append(time_once(ours, x, bf16))
            t_theirs.append(time_once(theirs, x, bf16))
    a, b = statistics.median(t_ours), statistics.median(t_theirs)
    return {"model": name, "batch": batch, "dtype": "bf16" if bf16 else "fp32",
            "vitlab_img_s": batch / a, "hf_img_s": batch / b, "ratio": b / a}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="vit-ti/16,vit-s/16,vit-b/16")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--gelu", choices=["tanh", "exact"], default="tanh",
                        help="GELU of both models: tanh (the official numerics, HF 'gelu_pytorch_tanh') "
                             "or exact (HF's default 'gelu')")
    args = parser.parse_args()
    import transformers

    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, vitlab {vitlab.__version__}, "
          f"GELU {args.gelu} in both")
    print("| model | batch | dtype | vitlab img/s | HF img/s | vitlab / HF |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for dtype in args.dtypes.split(","):
                reps = args.reps if batch * (4 if "b/" in name else 1) <= 32 else max(3, args.reps // 2)
                r = bench(name, batch, dtype == "bf16", reps, args.gelu)
                print(f"| {r['model']} | {r['batch']} | {r['dtype']} | {r['vitlab_img_s']:.1f} | "
                      f"{r['hf_img_s']:.1f} | {r['ratio']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
