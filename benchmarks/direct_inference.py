"""`--engine torch` with a ViT's blocks as direct operator calls (models/vit_direct.DirectInference) against the
same engine running them through the module tree, timed as `--engine auto` times its candidates
(`engine.choose.interleaved_speeds`: interleaved, a pause before each call, median of the rounds); also the largest
logit difference between the two (0: the same operators on the same values).

    python benchmarks/direct_inference.py                       # torch's default threads
    python benchmarks/direct_inference.py --threads 1 --models vit-ti/16 --batches 1
    python benchmarks/direct_inference.py --attempts --models vit-ti/16,vit-s/16,vit-b/16
    python benchmarks/direct_inference.py --model-call     # `model(x)` itself (no engine: live weights, nothing packed)
    python benchmarks/direct_inference.py --attempts --models fmnist --calls 200   # loops of 200 calls per sample
    python benchmarks/direct_inference.py --plan-check --models vit-ti/16,fmnist   # the per-call check alone

`--attempts` times two variants of the direct route that were tried and not kept (docs/benchmarks.md, "Tried and
not adopted"): the residual adds fused into the proj and fc2 products (oneDNN's binary post-op), and the attention
core of 197-token blocks as two batched products and a softmax instead of torch's fused kernel, and each block's
attention as one call of torch's private `_native_multi_head_attention` (fewer operator calls at batch 1); and, as
a reference, the route the kept one replaced: the attention through (B, H, N, hd) views of the fused projection.

`--plan-check` times what every direct call does before its blocks: the check that the plan still stands for the
model (`DirectInference._current`), back to back and right after a whole call at batch 1 (as in a real call, after
the blocks' weights have passed through the caches), median of `--rounds` x 20 samples, with the whole call's time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import vitlab
from vitlab.engine import choose
from vitlab.engine.torch_engines import TorchEngine
from vitlab.models import attention_core, vit_direct
from vitlab.runtime import tune_cpu_allocator

KEPT_BLOCK = vit_direct._block  # the direct route's block as shipped (the attempts swap it out)
FMNIST = dict(image_size=28, patch_size=4, dim=64, depth=6, heads=4, mlp_dim=128, num_classes=10, in_chans=1)


def model_and_images(name: str, batch: int) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "fmnist":  # the Fashion-MNIST-size ViT of benchmarks/linear.py
        model, shape = vitlab.create_model("custom", **FMNIST), (1, 28, 28)
    else:
        model, shape = vitlab.create_model(name), (3, 224, 224)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # non-zero heads and biases: a difference would show
    return model.eval(), torch.randn(batch, *shape)


def model_call(model: torch.nn.Module):
    """`model(x)` as a user's own code calls it in inference."""
    def run(images: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model(images)
    return run


def compare(name: str, batch: int, rounds: int, plain: bool = False, calls: int = 1) -> tuple[float, float, float]:
    """images/s through the modules, images/s direct, max |logit difference|; of the engine, or with `plain` of
    the model's own call."""
    model, x = model_and_images(name, batch)
    engine = model_call(model) if plain else TorchEngine(model)

    def route(direct: bool):
        def run(images: torch.Tensor) -> torch.Tensor:
            vit_direct.DIRECT_INFERENCE = direct
            return engine(images)
        return run

    modules, direct = route(False), route(True)
    diff = float((direct(x) - modules(x)).abs().max())
    speeds = speeds_of({"modules": modules, "direct": direct}, x, rounds, calls)
    vit_direct.DIRECT_INFERENCE = True
    return speeds["modules"], speeds["direct"], diff


def _linear_add(residual, x, weights, bias):
    """residual + vit_direct._linear(x, ...): the add as oneDNN's binary post-op where the product goes through
    oneDNN (the same sum to the last bit), else as the kept route adds it."""
    onednn, plain = weights
    small = vit_direct.fast_linear.small_product(vit_direct.fast_linear.product_rows(x), plain)
    if small or not residual.is_contiguous():
        return residual + vit_direct._linear(x, weights, bias)
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, onednn, bias, "add")


def _fused_add_block(x, p, queries, fused_gelu):
    """`vit_direct._block` with x + proj(out) and x + fc2(h) as oneDNN products with a binary-add post-op."""
    qkv = vit_direct._linear(F.layer_norm(x, *p.norm1), p.qkv_weight, p.qkv_bias)
    out = vit_direct.inference_attention(qkv, p.heads, queries)
    if queries is not None:
        x = x[:, :queries]
    x = _linear_add(x, out, p.proj_weight, p.proj_bias)
    h = vit_direct._fc1_gelu(F.layer_norm(x, *p.norm2), p, fused_gelu)
    return _linear_add(x, h, p.fc2_weight, p.fc2_bias)


def _views_attention_block(x, p, queries, fused_gelu):
    """`vit_direct._block` with the attention of every block through the (B, H, N, hd) views of the fused
    projection and `attention_core.attention` (`matmul` on the views where the explicit route applies): the route
    before `inference_attention`."""
    b, n, d = x.shape
    qkv = vit_direct._linear(F.layer_norm(x, *p.norm1), p.qkv_weight, p.qkv_bias)
    q, k, v = (t.transpose(1, 2) for t in qkv.view(b, n, 3, p.heads, d // p.heads).unbind(2))
    if queries is not None:
        q, n, x = q[:, :, :queries], queries, x[:, :queries]
    out = attention_core.attention(q, k, v, 0.0).transpose(1, 2).reshape(b, n, d)
    x = x + vit_direct._linear(out, p.proj_weight, p.proj_bias)
    h = vit_direct._fc1_gelu(F.layer_norm(x, *p.norm2), p, fused_gelu)
    return x + vit_direct._linear(h, p.fc2_weight, p.fc2_bias)


def _explicit_core_block(x, p, queries, fused_gelu):
    """`vit_direct._block` with every full block's attention core in the explicit form (any sequence length)."""
    limit = attention_core.EXPLICIT_MAX_TOKENS
    attention_core.EXPLICIT_MAX_TOKENS = 10**9 if queries is None else limit
    try:
        return KEPT_BLOCK(x, p, queries, fused_gelu)
    finally:
        attention_core.EXPLICIT_MAX_TOKENS = limit


def _native_attention_block(x, p, queries, fused_gelu):
    """`vit_direct._block` with LayerNorm-free attention as one call of torch's private fused
    `_native_multi_head_attention` (qkv projection, core and output projection; nn.MultiheadAttention's inference
    fast path), and fc1 + GELU, fc2 as F.linear: fewer operator calls, the same function up to fp32 rounding. The
    class-token-only last block and blocks without a qkv bias run as kept."""
    if queries is not None or p.qkv_bias is None or p.proj_bias is None:
        return KEPT_BLOCK(x, p, queries, fused_gelu)
    h = F.layer_norm(x, *p.norm1)
    x = x + torch._native_multi_head_attention(h, h, h, x.shape[-1], p.heads, p.qkv_weight[1], p.qkv_bias,
                                               p.proj_weight[1], p.proj_bias, None, False)[0]
    h = F.gelu(F.linear(F.layer_norm(x, *p.norm2), p.fc1_weight[1], p.fc1_bias), approximate=p.gelu)
    return x + F.linear(h, p.fc2_weight[1], p.fc2_bias)


def engine_with(engine, module, name: str, value, kept):
    """A run of `engine` with `module.name` set to `value` during each call, and back to `kept` after it."""
    def run(images: torch.Tensor) -> torch.Tensor:
        setattr(module, name, value)
        try:
            return engine(images)
        finally:
            setattr(module, name, kept)
    return run


def attempts(name: str, rounds: int, calls: int = 1) -> tuple[dict[str, float], dict[str, float]]:
    """images/s at batch 1 of the direct route as kept and of each variant tried, with max |logit difference|."""
    model, x = model_and_images(name, 1)
    engine = TorchEngine(model)
    kept = KEPT_BLOCK

    def variant(block):
        return engine_with(engine, vit_direct, "_block", block, kept)

    runs = {"direct": variant(kept), "fused residual add": variant(_fused_add_block),
            "explicit core at 197 tokens": variant(_explicit_core_block),
            "native fused attention": variant(_native_attention_block),
            "views' attention": variant(_views_attention_block)}
    reference = engine(x)
    diffs = {label: float((run(x) - reference).abs().max()) for label, run in runs.items()}
    return speeds_of(runs, x, rounds, calls), diffs


def speeds_of(runs: dict, x: torch.Tensor, rounds: int, calls: int = 1) -> dict[str, float]:
    """images/s of each run, interleaved (engine.choose.interleaved_speeds), each sample `calls` calls in a row
    (more than one times a loop of calls back to back, as timeit does)."""
    if calls == 1:
        return choose.interleaved_speeds(runs, x, rounds)

    def loop(run):
        def calls(images: torch.Tensor) -> torch.Tensor:
            for _ in range(calls - 1):
                run(images)
            return run(images)
        return calls

    speeds = choose.interleaved_speeds({label: loop(run) for label, run in runs.items()}, x, rounds)
    return {label: v * calls for label, v in speeds.items()}


def plan_check(name: str, samples: int) -> tuple[float, float, float]:
    """(us of the plan check back to back, us of it right after a call, ms of the whole call) at batch 1."""
    model, x = model_and_images(name, 1)
    engine = TorchEngine(model)
    direct = engine.direct
    with torch.inference_mode():
        tokens = model.embed(x)
    class_token_only = model._class_token_only(False)

    def check_us() -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            direct._current(tokens, class_token_only)
            return (time.perf_counter() - start) * 1e6

    for _ in range(5):
        engine(x)
    back_to_back = [check_us() for _ in range(samples)]
    after_call, calls = [], []
    for _ in range(samples):
        start = time.perf_counter()
        engine(x)
        calls.append(time.perf_counter() - start)
        after_call.append(check_us())
    return statistics.median(back_to_back), statistics.median(after_call), statistics.median(calls) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--models", default="vit-ti/16,vit-s/16,vit-b/16,fmnist")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--pause-ms", type=float, default=50)
    ap.add_argument("--calls", type=int, default=1,
                    help="calls per timed sample, back to back (the pause comes before each sample)")
    ap.add_argument("--attempts", action="store_true", help="time the variants tried and not kept (batch 1)")
    ap.add_argument("--plan-check", action="store_true",
                    help="time the per-call check of the direct route's plan alone (batch 1)")
    ap.add_argument("--model-call", action="store_true",
                    help="time `model(x)` itself (its own direct route: live weights, nothing packed) instead of "
                         "`--engine torch`")
    args = ap.parse_args()
    choose.PAUSE_S = args.pause_ms / 1e3
    torch.set_num_threads(args.threads)
    tune_cpu_allocator()  # as every vitlab command on the CPU runs
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.rounds} rounds, images/s, "
          f"{'model(x) under inference_mode' if args.model_call else '--engine torch'}")
    if args.plan_check:
        for name in args.models.split(","):
            hot, after_call, call_ms = plan_check(name, args.rounds * 20)
            print(f"  {name:10s} batch   1: plan check {hot:6.1f} us back to back, {after_call:6.1f} us right after "
                  f"a call ({after_call / 10 / call_ms:.1f} % of the call's {call_ms:.2f} ms)", flush=True)
        return
    if args.attempts:
        for name in args.models.split(","):
            speeds, diffs = attempts(name, args.rounds, args.calls)
            print(f"  {name:10s} batch   1: " + "  ".join(
                f"{label} {v:.2f} (x{v / speeds['direct']:.3f}, max |logit difference| {diffs[label]:.1e})"
                for label, v in speeds.items()), flush=True)
        return
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            modules, direct, diff = compare(name, batch, args.rounds, args.model_call, args.calls)
            print(f"  {name:10s} batch {batch:3d}: modules {modules:8.2f}  direct {direct:8.2f}  "
                  f"(x{direct / modules:.3f})  max |logit difference| {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
