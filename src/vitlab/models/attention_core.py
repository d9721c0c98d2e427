"""softmax(q k^T / sqrt(d)) v by the faster of two exact routes on the CPU.

torch's fused CPU kernel (`F.scaled_dot_product_attention`, flash attention) gains little from a second thread
on short sequences, where the same function written as two batched matrix products and a softmax gains almost
2x. With 2 threads, at 50 tokens with 16-dim heads (the Fashion-MNIST ViT, 128 images), forward + backward takes
10.35 ms fused against 7.02 explicit; at ViT-B/32's 50 tokens (64-dim heads) 7.64 against 6.00. With 1 thread the
fused kernel is as fast or faster (12.41 vs 13.05 ms), and from about 129 tokens on it is faster at any thread
count and never holds the (B, H, N, N) probabilities; ViT-*/16 at 224 px (197 tokens) always keeps it.
Measured with `python benchmarks/attention.py` (--threads 1 and 2; docs/results/attention_*threads.txt). Both
routes compute the official function (the explicit form is how the official Flax code writes it), within 1e-6 of
the largest output of each other (tests/test_model_attention_core.py). The rule depends on the shape and the thread count only, never on a
timing; training records its thread count and restores it on resume, so a run and its resume take the same route.
Where TorchEngine runs a small call on one thread, the route stays the one of the caller's thread count
(`route_threads_pinned`): where that route is the explicit one, the call gives model(x)'s logits to the last bit
(the fused kernel itself may round differently on one thread).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from vitlab.models.fast_linear import cpu_fp32_eager, needs_grad

EXPLICIT_ATTENTION = True  # benchmarks and tests flip it to time or compare the fused kernel alone
EXPLICIT_MAX_TOKENS = 80  # 2 threads: explicit faster up to 65 tokens, even at 101, fused faster from 129 on
SCALE_IN_PRODUCT = True  # a power-of-two scale as the score product's alpha (_scaled_scores); benchmarks flip it
_NO_INPUT = torch.zeros(())  # baddbmm's added input, ignored at beta=0 (read by no kernel, so shared)


# The thread count the route is picked for, where it is not torch's current one (route_threads_pinned)
_ROUTE_THREADS: ContextVar[int | None] = ContextVar("vitlab_attention_route_threads", default=None)


@contextlib.contextmanager
def route_threads_pinned(threads: int) -> Iterator[None]:
    """Pick the route for `threads` threads in this block, whatever torch's thread count is meanwhile."""
    token = _ROUTE_THREADS.set(threads)
    try:
        yield
    finally:
        _ROUTE_THREADS.reset(token)


def explicit_attention_applies(q: torch.Tensor, queries: int | None = None) -> bool:
    """Whether the explicit route computes attention for q (B, H, N, hd), or for `queries` query tokens of q's kind."""
    if not (EXPLICIT_ATTENTION and cpu_fp32_eager(q)
            and (q.shape[-2] if queries is None else queries) <= EXPLICIT_MAX_TOKENS):
        return False
    # read only on the eager path: torch.compile cannot trace a ContextVar, and broke the graph at every block
    threads = _ROUTE_THREADS.get()
    return (torch.get_num_threads() if threads is None else threads) > 1


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float = 0.0,
                       training: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, probabilities) for (B, H, N, d) inputs; dropout acts on the probabilities, as in the fused kernel."""
    probs = ((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)).softmax(dim=-1)
    if training and dropout > 0:  # else F.dropout returns its input: one call less per block at inference
        return F.dropout(probs, dropout, training) @ v, probs
    return probs @ v, probs


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float = 0.0) -> torch.Tensor:
    """Multi-head attention of (B, H, N, d) tensors (dropout > 0 only while training)."""
    if explicit_attention_applies(q):
        return explicit_attention(q, k, v, dropout, dropout > 0)[0]
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)


def _scaled_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """(q * scale) @ k^T for (BH, n, hd) and (BH, N, hd). Where the scale is a power of two (head sizes 4, 16, 64,
    256: every ViT of the paper but ViT-H's 80), multiplying by it is exact (short of subnormal values), so the
    product's own alpha gives the same bits without a pass over q (tests/test_model_attention_core.py).
    `--engine torch` on the Fashion-MNIST ViT at batch 32: 1.013-1.032x in two runs, level at batch 1 and at
    ViT-B/32 (`python benchmarks/attention_scale.py`, docs/results/attention_scale.txt)."""
    if SCALE_IN_PRODUCT and math.frexp(scale)[0] == 0.5:
        return torch.baddbmm(_NO_INPUT.expand(q.shape[0], q.shape[1], k.shape[1]), q, k.transpose(1, 2),
                             beta=0, alpha=scale)
    return torch.bmm(q * scale, k.transpose(1, 2))


def inference_attention(qkv: torch.Tensor, heads: int, queries: int | None = None) -> torch.Tensor:
    """Multi-head attention in inference (no dropout) from the fused projection qkv (B, N, 3D; rows ordered q, k, v,
    heads contiguous), merged back to (B, n, D), n = `queries` (only the first tokens attend) or N.

    Where the explicit route applies and no gradient is wanted, one copy lays q, k, v out as (3, B x H, N, hd) and
    two batched products run on them as they are; the (B, H, N, hd) views cost `matmul` a copy of each operand and
    a dozen view calls. The Fashion-MNIST ViT at batch 1 (--engine torch), loops of 200 calls: 1.00-1.06x, the same
    logits (`python benchmarks/direct_inference.py --attempts --calls 200`, the "views' attention" row;
    docs/results/direct_inference_attempts_qkv_attention.txt): a small gain near this VM's noise, kept because it
    costs nothing elsewhere (ViT-Ti/16 batch 1: within 2 %). Elsewhere the views and `attention`.
    Attention.forward and vit_direct's blocks both compute inference this way, so they agree to the last bit."""
    b, n, three_d = qkv.shape
    d = three_d // 3
    hd = d // heads
    if explicit_attention_applies(qkv, n if queries is None else queries) and not needs_grad(qkv):
        q, k, v = qkv.view(b, n, 3, heads, hd).permute(2, 0, 3, 1, 4).reshape(3, b * heads, n, hd).unbind(0)
        if queries is not None:
            q = q[:, :queries]
        probs = _scaled_scores(q, k, hd ** -0.5).softmax(dim=-1)
        out = torch.bmm(probs, v).view(b, heads, -1, hd)
    else:
        # as Attention.forward has always cut them (an exported ONNX graph keeps its Split and fusions)
        q, k, v = (t.reshape(b, n, heads, hd).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        if queries is not None:
            q = q[:, :, :queries]
        out = attention(q, k, v, 0.0)
    return out.transpose(1, 2).reshape(b, out.shape[2], d)
