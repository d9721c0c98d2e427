"""Training throughput: vitlab's ViT vs a Hugging Face ViT of the same size, driven by the same loop.

Both models get the same batch, optimiser (AdamW, the paper's decay mask is not used here so both do
exactly the same optimiser work), loss, autocast setting and thread count. Rounds alternate between the
two (A B A B ...) so that load from other processes on a shared machine hits both alike; the result is
the ratio of median images/s (vitlab / HF; > 1 means vitlab is faster).

    python benchmarks/train.py                       # the Fashion-MNIST model and ViT-Ti/16 at 224 on CPU
    python benchmarks/train.py --sizes fmnist --rounds 7 --steps 5 --precision fp32 --threads 1
    python benchmarks/train.py --sizes fmnist --compile   # adds vitlab under torch.compile (+ its compile time)

Besides the ratio of medians it prints the spread of the per-round ratios (each round times both models
back to back, so a round's ratio cancels slow drifts of the machine): the 25th-75th percentile range
says whether a difference is larger than this machine's noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# name -> (image size, channels, patch, dim, depth, heads, mlp, batch)
SIZES = {
    "fmnist": (28, 1, 4, 64, 6, 4, 128, 128),  # the model of docs/RESULTS.md
    "ti16": (224, 3, 16, 192, 12, 3, 768, 16),  # ViT-Ti/16 at 224
    "s16": (224, 3, 16, 384, 12, 6, 1536, 8),  # ViT-S/16 at 224
}


def build_vitlab(size):
    from vitlab.models.registry import create_model

    img, ch, p, d, depth, heads, mlp, _ = size
    return create_model("custom", num_classes=10, image_size=img, in_chans=ch, patch_size=p, dim=d, depth=depth,
                        heads=heads, mlp_dim=mlp, seed=0)


class HFLogits(nn.Module):
    """transformers' ViTForImageClassification returning plain logits (same call as vitlab's)."""

    def __init__(self, size):
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification

        img, ch, p, d, depth, heads, mlp, _ = size
        cfg = ViTConfig(hidden_size=d, num_hidden_layers=depth, num_attention_heads=heads, intermediate_size=mlp,
                        image_size=img, patch_size=p, num_channels=ch, num_labels=10, hidden_act="gelu_pytorch_tanh",
                        layer_norm_eps=1e-6, qkv_bias=True, attn_implementation="sdpa")
        self.inner = ViTForImageClassification(cfg)

    def forward(self, x):
        return self.inner(pixel_values=x).logits


def make_step(model, x, y, precision):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else None

    def step():
        if ctx is None:
            loss = F.cross_entropy(model(x), y)
        else:
            with ctx():
                loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def bench(size_name, rounds, steps, precision, compile_too=False):
    size = SIZES[size_name]
    img, ch, *_, batch = size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, ch, img, img, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    models = {"vitlab": build_vitlab(size), "hf": HFLogits(size)}
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    steppers = {k: make_step(m.train(), x, y, precision) for k, m in models.items()}
    compile_s = None
    if compile_too:  # a separate copy, so the eager model's numbers stay those of the eager model
        compiled = build_vitlab(size).train()
        steppers["vitlab_compiled"] = make_step(torch.compile(compiled), x, y, precision)
        t = time.perf_counter()
        steppers["vitlab_compiled"]()  # the first call compiles forward and backward
        compile_s = time.perf_counter() - t
    for s in steppers.values():  # warm-up
        s()
        s()
    rates = {k: [] for k in steppers}
    order = list(steppers)
    for r in range(rounds):  # alternate which model goes first: the second runner was systematically favoured
        for k in (order if r % 2 == 0 else order[::-1]):
            s = steppers[k]
            t = time.perf_counter()
            for _ in range(steps):
                s()
            rates[k].append(batch * steps / (time.perf_counter() - t))
    med = {k: statistics.median(v) for k, v in rates.items()}
    out = {"size": size_name, "image_size": img, "batch": batch, "precision": precision,
           "threads": torch.get_num_threads(), "params": params, "rounds": rounds, "steps_per_round": steps,
           "vitlab_images_per_s": med["vitlab"], "hf_images_per_s": med["hf"],
           "ratio_vitlab_over_hf": med["vitlab"] / med["hf"],
           "round_ratio_quartiles": _quartiles([a / b for a, b in zip(rates["vitlab"], rates["hf"])])}
    if compile_too:
        out.update(compiled_images_per_s=med["vitlab_compiled"], compile_s=compile_s,
                   ratio_compiled_over_hf=med["vitlab_compiled"] / med["hf"],
                   ratio_compiled_over_eager=med["vitlab_compiled"] / med["vitlab"])
    return out


def _quartiles(values):
    """25th, 50th and 75th percentile (n >= 2; a single round gives its value three times)."""
    if len(values) < 2:
        return [values[0]] * 3
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], q[1], q[2]]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="fmnist,ti16", help=f"comma-separated: {', '.join(SIZES)}")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="training steps per round")
    ap.add_argument("--precision", default="fp32", help="fp32, bf16 (CPU autocast) or both: fp32,bf16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tune-allocator", action="store_true",
                    help="raise glibc's mmap/trim thresholds first, as `vitlab train` does on CPU")
    ap.add_argument("--compile", action="store_true", help="also time vitlab's model under torch.compile")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.tune_allocator:
        from vitlab.runtime import tune_cpu_allocator

        print(f"allocator tuned: {tune_cpu_allocator()}")
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'size':8} {'prec':>5} {'batch':>5} {'params':>10} {'vitlab img/s':>13} {'HF img/s':>10} {'ratio':>7}"
          f" {'round ratios p25-p75':>21}")
    for precision in args.precision.split(","):
        for name in args.sizes.split(","):
            r = bench(name.strip(), args.rounds, args.steps, precision.strip(), args.compile)
            results.append(r)
            q = r["round_ratio_quartiles"]
            print(f"{r['size']:8} {r['precision']:>5} {r['batch']:>5} {r['params']['vitlab']:>10,} "
                  f"{r['vitlab_images_per_s']:>13.1f} {r['hf_images_per_s']:>10.1f} {r['ratio_vitlab_over_hf']:>7.2f}"
                  f" {q[0]:>10.2f}-{q[2]:.2f}", flush=True)
            if args.compile:
                print(f"{'':8} torch.compile: {r['compiled_images_per_s']:.1f} img/s after {r['compile_s']:.1f} s "
                      f"of compilation; x{r['ratio_compiled_over_eager']:.2f} vs eager vitlab, "
                      f"x{r['ratio_compiled_over_hf']:.2f} vs HF", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
