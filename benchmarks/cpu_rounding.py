"""How far fp32 results move with the CPU's kernels: the figures behind the test bounds that depend on them.

Run it as is, and with the kernels held to older instruction sets to stand in for other CPUs:

    python benchmarks/cpu_rounding.py
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/cpu_rounding.py
    ATEN_CPU_CAPABILITY=default python benchmarks/cpu_rounding.py      # torch's scalar kernels

Each line is one test's measured quantity (tests/ is put on the path to reuse their fixtures):
  BiT-R50x1 logits against bit_pytorch's    tests/test_weights_bit.py (LOGIT_ATOL)
  attention gradients, fused kernel         tests/test_model_attention_core.py
  sigmoid-form GELU gradient                tests/test_model_gelu.py
  key bias under gradient accumulation      tests/test_train_loop.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def bit_logits() -> str:
    import numpy as np

    import test_weights_bit as T
    from vitlab.weights import big_transfer

    case, image, want = T._case("r50x1")
    arrays = T.bit_recipe(case["layers"], case["width_factor"], case["head_size"], case["seed"])
    config, sd, _ = big_transfer.read_arrays(arrays, "r50x1.npz")
    diff = float(np.abs(T._logits(T._built(config, sd), image) - want).max())
    return f"BiT-R50x1 logits against bit_pytorch: max |d| {diff:.3g} (largest logit {float(np.abs(want).max()):.3g})"


def attention_gradients() -> str:
    from test_model_attention_core import max_diff, qkv
    from vitlab.models import attention_core

    torch.set_num_threads(2)
    rows = []
    for tokens in (17, 50, 80):
        q, k, v = qkv(tokens)
        g = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
        ours = torch.autograd.grad(attention_core.attention(q, k, v), (q, k, v), g)
        fused = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), g)
        truth = torch.autograd.grad(F.scaled_dot_product_attention(q.double(), k.double(), v.double()), (q, k, v),
                                    g.double())
        rows.append(f"{tokens} tokens: explicit - fused {max(max_diff(a, b) for a, b in zip(ours, fused)):.3g}, "
                    f"fused - float64 {max(max_diff(b, t) for b, t in zip(fused, truth)):.3g}, largest gradient "
                    f"{max(float(t.abs().max()) for t in truth):.3g}")
    return "attention gradients: " + "; ".join(rows)


def gelu_gradient() -> str:
    from test_model_gelu import values
    from vitlab.models import gelu

    x = values().requires_grad_()
    g = values(seed=1) / 4
    (ours,) = torch.autograd.grad(gelu.SlopeSavingTanhGelu.apply(x), x, g)
    (torchs,) = torch.autograd.grad(F.gelu(x, approximate="tanh"), x, g)
    exact = torch.autograd.grad(F.gelu(x.double(), approximate="tanh"), x, g.double())[0]
    return (f"tanh GELU gradient against float64: vitlab's slope {float((ours.double() - exact).abs().max()):.3g}, "
            f"torch's {float((torchs.double() - exact).abs().max()):.3g} (largest gradient "
            f"{float(exact.abs().max()):.3g})")


def key_bias_under_accumulation() -> str:
    from test_train_loop import tiny_cfg, tiny_data
    from vitlab.train import train

    exact = dict(device="cpu", precision="fp32", save_model=False)  # as the test runs it
    with tempfile.TemporaryDirectory() as tmp:
        one = train(tiny_cfg(Path(tmp), name="one", **exact), data=tiny_data()).model.state_dict()
        acc = train(tiny_cfg(Path(tmp), name="acc", micro_batch=4, **exact), data=tiny_data()).model.state_dict()
    bias = (one["blocks.0.attn.qkv.bias"] - acc["blocks.0.attn.qkv.bias"]).abs()
    dim = len(bias) // 3  # q, k, v
    rest = max(float((one[k] - acc[k]).abs().max()) for k in one if k != "blocks.0.attn.qkv.bias")
    return (f"16 x 1 against 4 x 4 accumulation: key bias {float(bias[dim:2 * dim].max()):.3g}, query and value "
            f"biases {float(torch.cat([bias[:dim], bias[2 * dim:]]).max()):.3g}, every other weight {rest:.3g}")


def main() -> None:
    setting = {k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY") if k in os.environ}
    print(f"torch {torch.__version__}, {setting or 'the kernels torch picks for this CPU'}")
    for measure in (bit_logits, attention_gradients, gelu_gradient, key_bias_under_accumulation):
        print(measure(), flush=True)


if __name__ == "__main__":
    main()
