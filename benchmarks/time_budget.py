"""Where `--engine torch` spends a ViT's inference time, measured against what this machine's fp32 matrix products
can reach: each kind of operator's milliseconds per call (torch.profiler, self time) and, for the matrix
products and the attention core, the GFLOP/s it reaches, beside the peak of one large product through oneDNN and
through torch's own `mm` (MKL). It shows how much any faster formulation could still win: time already near the
peak cannot shrink, time far below it can.

    python benchmarks/time_budget.py                                  # ViT-Ti/16, S/16, B/16 at batch 1
    python benchmarks/time_budget.py --models vit-s/16 --batch 32
    python benchmarks/time_budget.py --alternatives          # and other exact forms of the slow parts

The profiler adds its own cost to every operator, most to the short ones; the wall time per call, timed
without it, comes first.

`--alternatives` also times other exact forms of the two parts below the peak, on the model's own shapes
(interleaved, median of the rounds, microseconds per call): the attention core as torch's fused kernel (with the
threads given and with one), as two batched products and a softmax (`attention_core.explicit_attention`), as one
oneDNN product per head, and as grouped 1x1 convolutions through oneDNN (the heads as groups); and the patch
embedding as the strided convolution against one oneDNN product of the unfolded patches.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.profiler import profile

import vitlab
from vitlab.engine.torch_engines import TorchEngine
from vitlab.models.attention_core import explicit_attention
from vitlab.runtime import tune_cpu_allocator

# profiler operator name -> the part of the model it is
KINDS = {
    # the smallest products run through F.linear (addmm), the rest through oneDNN (fast_linear, gelu); the head is in
    # the time (its FLOPs, about 1.5 in ten thousand of a ViT-Ti/16's, are not in model_flops)
    "mkldnn::_linear_pointwise": "linear layers", "aten::addmm": "linear layers", "aten::gelu": "GELU",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention core",
    "aten::bmm": "attention core", "aten::_softmax": "attention core",
    "aten::mkldnn_convolution": "patch embedding",
    "aten::native_layer_norm": "LayerNorm", "aten::add": "residual adds",
}


def model_flops(cfg, tokens: int) -> dict[str, float]:
    """fp32 FLOPs per image of the linear layers and of the attention core, with the last block computing the
    class token alone (as `model(x)` does for a class-token ViT)."""
    d, mlp, depth, n = cfg.dim, cfg.mlp_dim, cfg.depth, tokens
    per_row = 2 * d * (d + 2 * mlp)  # proj, fc1, fc2 for one token
    linear = depth * 2 * n * d * 3 * d + (depth - 1) * n * per_row + per_row
    attention = (depth - 1) * 4 * n * n * d + 4 * n * d
    return {"linear layers": linear, "attention core": attention}


def peak_gflops(rounds: int = 5) -> dict[str, float]:
    a, w = torch.randn(2048, 2048), torch.randn(2048, 2048)
    routes = {"oneDNN": lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""),
              "torch mm (MKL)": lambda: a @ w.t()}
    out = {}
    for name, run in routes.items():
        run()
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        out[name] = 2 * 2048 ** 3 / min(times) / 1e9
    return out


def interleaved_us(routes: dict, rounds: int = 9, calls: int = 30) -> dict[str, float]:
    """Microseconds per call of each route: interleaved rounds, median."""
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(rounds):
        for label, run in routes.items():
            threads = torch.get_num_threads()
            torch.set_num_threads(getattr(run, "threads", threads))
            for _ in range(3):
                run()
            t = time.perf_counter()
            for _ in range(calls):
                run()
            times[label].append((time.perf_counter() - t) / calls * 1e6)
            torch.set_num_threads(threads)
    return {label: statistics.median(ts) for label, ts in times.items()}


def one_thread(run):
    run.threads = 1
    return run


def attention_forms(batch: int, heads: int, tokens: int, head_dim: int) -> dict:
    """The attention core of (batch, heads, tokens, head_dim) from a fused qkv output, in several exact forms."""
    qkv = torch.randn(batch, tokens, 3, heads, head_dim)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    linear = torch.ops.mkldnn._linear_pointwise.default
    scale = head_dim ** -0.5

    def per_head():  # scores = q_h k_h^T and out = p_h v_h as oneDNN products, k_h and v_h^T as the weights
        keys, values_t = k.contiguous(), v.transpose(-2, -1).contiguous()
        return [linear((linear(q[b, h], keys[b, h], None, "none", [], "") * scale).softmax(-1), values_t[b, h],
                       None, "none", [], "") for b in range(batch) for h in range(heads)]

    def grouped_conv():  # tokens as a 1 x N image, channels heads x head_dim (then heads x tokens), heads as groups
        out = []
        for b in range(batch):
            image = (qkv[b, :, 0] * scale).reshape(1, 1, tokens, heads * head_dim).permute(0, 3, 1, 2)
            keys = qkv[b, :, 1].transpose(0, 1).reshape(heads * tokens, head_dim, 1, 1)
            scores = F.conv2d(image, keys, groups=heads).permute(0, 2, 3, 1).reshape(tokens, heads, tokens)
            probs = scores.softmax(-1).reshape(1, 1, tokens, heads * tokens).permute(0, 3, 1, 2)
            values = qkv[b, :, 2].permute(1, 2, 0).reshape(heads * head_dim, tokens, 1, 1)
            out.append(F.conv2d(probs, values, groups=heads))
        return out

    return {"fused kernel (torch SDPA)": lambda: F.scaled_dot_product_attention(q, k, v),
            "fused kernel, 1 thread": one_thread(lambda: F.scaled_dot_product_attention(q, k, v)),
            "explicit: bmm, softmax, bmm": lambda: explicit_attention(q, k, v)[0],
            "one oneDNN product per head": per_head,
            "heads as grouped 1x1 convolutions": grouped_conv}


def patch_forms(model, x: torch.Tensor) -> dict:
    proj, p = model.patch_embed.proj, model.config.patch_size
    weight = torch.ops.mkldnn._reorder_linear_weight(proj.weight.reshape(proj.weight.shape[0], -1).detach(),
                                                     x.shape[0] * (x.shape[-2] // p) * (x.shape[-1] // p))

    def unfolded():
        b, c, height, width = x.shape
        patches = x.reshape(b, c, height // p, p, width // p, p).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(b, (height // p) * (width // p), c * p * p)
        return torch.ops.mkldnn._linear_pointwise(patches, weight, proj.bias, "none", [], "")

    return {"patch embedding: strided convolution": lambda: proj(x).flatten(2).transpose(1, 2),
            "patch embedding: unfold + one oneDNN product": unfolded}


def alternatives(model, x: torch.Tensor, tokens: int) -> None:
    cfg = model.config
    flops = 4 * x.shape[0] * cfg.heads * tokens * tokens * (cfg.dim // cfg.heads)
    with torch.no_grad():
        attention = interleaved_us(attention_forms(x.shape[0], cfg.heads, tokens, cfg.dim // cfg.heads))
        patches = interleaved_us(patch_forms(model, x))
    print(f"  attention core of one block ({cfg.heads} heads x {tokens} tokens x {cfg.dim // cfg.heads}):")
    for label, us in attention.items():
        print(f"    {label:38s} {us:8.1f} us   {flops / us / 1e3:6.1f} GFLOP/s")
    for label, us in patches.items():
        print(f"  {label:40s} {us:8.1f} us")


def budget(name: str, batch: int, calls: int, forms: bool = False) -> None:
    torch.manual_seed(0)
    model = vitlab.create_model(name).eval()
    engine = TorchEngine(model)
    height, width = model.config.grid_size
    p = model.config.patch_size
    x = torch.randn(batch, model.config.in_chans, height * p, width * p)
    tokens = height * width + 1  # the class token
    with torch.no_grad():
        for _ in range(5):
            engine(x)
        walls = []
        for _ in range(calls):
            t = time.perf_counter()
            engine(x)
            walls.append(time.perf_counter() - t)
        with profile() as prof:
            for _ in range(calls):
                engine(x)
    spent: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        spent[KINDS.get(event.key, "everything else")] += event.self_cpu_time_total / 1e3 / calls
    flops = {k: v * batch for k, v in model_flops(model.config, tokens).items()}
    wall = statistics.median(walls) * 1e3
    print(f"\n{name}, batch {batch}: {wall:.2f} ms per call without the profiler, "
          f"{sum(spent.values()):.2f} ms with it ({calls} calls)")
    for kind, ms in sorted(spent.items(), key=lambda kv: -kv[1]):
        rate = f"   {flops[kind] / ms / 1e6:6.1f} GFLOP/s" if kind in flops else ""
        print(f"  {kind:26s} {ms:8.2f} ms  {100 * ms / sum(spent.values()):5.1f} %{rate}")
    if forms:
        alternatives(model, x, tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="vit-ti/16,vit-s/16,vit-b/16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--alternatives", action="store_true",
                    help="also time other exact forms of the attention core and the patch embedding")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tune_cpu_allocator()
    print(f"torch {torch.__version__}, {args.threads} threads")
    print("peak of one 2048^3 fp32 product: " + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peak_gflops().items()))
    for name in args.models.split(","):
        budget(name, args.batch, args.calls, args.alternatives)


if __name__ == "__main__":
    main()
