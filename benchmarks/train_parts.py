"""Parts of a training step timed on their own, each against the alternative vitlab did not choose.

1. Optimizer step of the Fashion-MNIST model (422k parameters): torch's AdamW default (per-tensor loop),
   `foreach=True` and `fused=True` (what `vitlab.train.optim.build_optimizer` uses).
2. A hybrid's patch projection (64 x 28 x 28 stem map -> 7 x 7 patches -> width 64), forward + backward:
   the strided convolution against `PatchEmbed._project_as_matmul` (what hybrids use).
3. A whole training step (forward, backward, fused AdamW) of the two Fashion-MNIST hybrids: the earlier
   one-convolution stem (64 channels at 28 x 28, 7 x 7 patches) and the conv stem of the preset
   (3 x 3 stride-2 convolutions with 48, 96, 192 channels, 1 x 1 patches); both give 16 tokens. The conv
   stem once more with the tanh GELU (the preset uses the exact one) and with `--precision bf16-stem`
   (the stem's convolutions in bf16, the Transformer in fp32).
4. Self-attention forward + backward from the fused qkv projection: q, k, v cut by a permute of
   (B, N, 3, H, hd) against chunks along the features (what `vitlab.models.vit.Attention` does), for the
   width-64 ViT of benchmarks/train.py (128 images, 50 tokens) and ViT-Ti/16 (16 images, 197 tokens).
5. GELU forward + backward on the preset's MLP activations (64 images x 16 tokens x 128): tanh form
   against the exact (erf) one.
6. The bf16 / fp32 speed-up that `--precision auto` measures on a CPU (`vitlab.train.precision`).
7. The preset's conv stem alone, forward + backward, in fp32 and bf16 (its share of the training step).

Rounds alternate the candidates; medians are reported.

    python benchmarks/train_parts.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# The model of the first Fashion-MNIST preset: one 3x3 stride-1 convolution (64 channels), 7x7 patches.
ONE_CONV_HYBRID = dict(resnet=dict(layers=[], stem="small"), patch_size=7, conv_stem=[])


def fmnist_model(**changes):
    from vitlab.models.registry import create_model
    from vitlab.train.config import FMNIST_HYBRID

    return create_model("custom", num_classes=10, image_size=28, in_chans=1, seed=0, **{**FMNIST_HYBRID, **changes})


def median_ms(candidates: dict, rounds: int, calls: int) -> dict[str, float]:
    times = {k: [] for k in candidates}
    order = list(candidates)
    for r in range(rounds):
        for k in (order if r % 2 == 0 else order[::-1]):
            t = time.perf_counter()
            for _ in range(calls):
                candidates[k]()
            times[k].append((time.perf_counter() - t) / calls * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def optimizer_steps(rounds: int) -> dict[str, float]:
    from vitlab.train.optim import param_groups

    model = fmnist_model()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    steps = {}
    for name, kw in {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}.items():
        opt = torch.optim.AdamW(param_groups(model, 0.05), lr=1e-3, **kw)
        opt.step()
        steps[name] = opt.step
    return median_ms(steps, rounds, 20)


def patch_projection(rounds: int, batch: int) -> dict[str, float]:
    pe = fmnist_model(**ONE_CONV_HYBRID).patch_embed
    feats = torch.randn(batch, 64, 28, 28, requires_grad=True)

    def conv():
        F.conv2d(feats, pe.proj.weight, pe.proj.bias, stride=pe.patch_size).sum().backward()

    def matmul():
        pe._project_as_matmul(feats)[0].sum().backward()

    for f in (conv, matmul):
        f()
    return median_ms({"convolution": conv, "matmul": matmul}, rounds, 5)


def training_steps(rounds: int, batch: int) -> dict[str, float]:
    from vitlab.train.precision import set_stem_precision

    steps = {}
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    variants = {"one-conv stem": ONE_CONV_HYBRID, "conv stem": {}, "conv stem, tanh GELU": {"gelu": "tanh"},
                "conv stem bf16": {}}
    for name, changes in variants.items():
        model = fmnist_model(**changes).train()
        if name.endswith("bf16"):
            set_stem_precision(model, "bf16-stem")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

        def step(model=model, opt=opt):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        steps[name] = step
    return median_ms(steps, rounds, 5)


def attention_splits(rounds: int) -> dict[str, float]:
    out = {}
    for label, (b, n, d, h) in {"width 64": (128, 50, 64, 4), "ViT-Ti/16": (16, 197, 192, 3)}.items():
        x = torch.randn(b, n, d, requires_grad=True)
        w, bias = torch.randn(3 * d, d, requires_grad=True), torch.randn(3 * d, requires_grad=True)

        def permute(b=b, n=n, d=d, h=h, x=x, w=w, bias=bias):
            q, k, v = F.linear(x, w, bias).reshape(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4).unbind(0)
            F.scaled_dot_product_attention(q, k, v).sum().backward()

        def chunks(b=b, n=n, d=d, h=h, x=x, w=w, bias=bias):
            q, k, v = (t.reshape(b, n, h, d // h).transpose(1, 2) for t in F.linear(x, w, bias).chunk(3, dim=-1))
            F.scaled_dot_product_attention(q, k, v).sum().backward()

        for f in (permute, chunks):
            f()
        for name, ms in median_ms({"permute": permute, "chunks": chunks}, rounds, 5).items():
            out[f"{label}, {name}"] = ms
    return out


def gelu_forms(rounds: int) -> dict[str, float]:
    x = torch.randn(64 * 16, 128, requires_grad=True)

    def form(approximate):
        return lambda: F.gelu(x, approximate=approximate).sum().backward()

    return median_ms({"tanh": form("tanh"), "exact": form("none")}, rounds, 20)


def stem_alone(rounds: int, batch: int) -> dict[str, float]:
    from vitlab.train.precision import set_stem_precision

    model = fmnist_model().train()
    x = torch.randn(batch, 1, 28, 28)

    def run(precision):
        def f():
            set_stem_precision(model, precision)
            model.patch_embed.stem(x).sum().backward()
        return f

    return median_ms({"fp32": run("fp32"), "bf16": run("bf16-stem")}, rounds, 5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32, help="images per patch-projection call and training step")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, ms in optimizer_steps(args.rounds).items():
        print(f"AdamW step, {name:>8}: {ms:6.2f} ms")
    for name, ms in patch_projection(args.rounds, args.batch).items():
        print(f"patch projection fwd+bwd, {args.batch} images, {name:>11}: {ms:6.2f} ms")
    for name, ms in training_steps(args.rounds, args.batch).items():
        print(f"training step, {args.batch} images, {name:>20}: {ms:6.2f} ms")
    for name, ms in attention_splits(args.rounds).items():
        print(f"attention fwd+bwd, {name:>20}: {ms:6.2f} ms")
    for name, ms in gelu_forms(args.rounds).items():
        print(f"GELU fwd+bwd, 1024 x 128, {name:>5}: {ms:6.3f} ms")
    for name, ms in stem_alone(args.rounds, args.batch).items():
        print(f"conv stem alone fwd+bwd, {args.batch} images, {name}: {ms:6.2f} ms")
    from vitlab.train.precision import cpu_bf16_speedup

    print(f"bf16 / fp32 speed-up of a 512 x 512 matmul (what --precision auto measures): {cpu_bf16_speedup():.2f}")


if __name__ == "__main__":
    main()
