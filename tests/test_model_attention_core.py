"""The explicit attention route of short sequences (vitlab.models.attention_core) against torch's fused kernel,
the reference, and a float64 truth: output and gradients equal up to fp32 rounding, dropout where the fused kernel
puts it, and the fused kernel everywhere the rule does not apply (long sequences, bf16, tracing)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vitlab
from vitlab.models import attention_core


def qkv(tokens: int, batch: int = 3, heads: int = 4, head_size: int = 16, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, heads, tokens, head_size, generator=gen) * 2).requires_grad_() for _ in range(3)]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


@pytest.mark.parametrize("tokens", [1, 17, 50, 80])
def test_explicit_route_equals_the_fused_kernel_and_the_float64_truth(tokens, keep_torch_threads):
    torch.set_num_threads(2)
    assert attention_core.explicit_attention_applies(qkv(tokens)[0])
    q, k, v = qkv(tokens)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    ours = attention_core.attention(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v)
    truth = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    scale = float(truth.detach().abs().max())  # fp32 rounding: about 5e-7 of the largest output either way
    assert max_diff(ours, ref) <= 1e-6 * scale and max_diff(ours, truth) <= 1e-6 * scale
    assert max_diff(ours, truth) <= 2 * max_diff(ref, truth) + 1e-7
    grads = torch.autograd.grad(ours, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    truth_grads = torch.autograd.grad(truth, (q, k, v), g.double())
    for a, b, t in zip(grads, ref_grads, truth_grads):
        # the fused kernel's own gradients are up to 1.3e-5 off the float64 truth here (largest gradient 14):
        # the two fp32 routes differ by about as much, more or less depending on the CPU's kernels
        assert max_diff(a, b) <= max(1e-5, 2e-6 * float(t.abs().max()))
        assert max_diff(a, t) <= 2 * max_diff(b, t) + 1e-6


def fused_calls(monkeypatch) -> list[int]:
    calls = []
    real = F.scaled_dot_product_attention

    def counting(q, *args, **kwargs):
        calls.append(q.shape[-2])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(attention_core.F, "scaled_dot_product_attention", counting)
    return calls


def test_the_rule_depends_on_the_token_and_thread_counts_only(monkeypatch, keep_torch_threads):
    calls = fused_calls(monkeypatch)
    limit = attention_core.EXPLICIT_MAX_TOKENS
    with torch.no_grad():
        for n_threads in (2, 1):
            torch.set_num_threads(n_threads)
            for tokens in (limit, limit + 1):
                attention_core.attention(*qkv(tokens))
    assert calls == [limit + 1, limit, limit + 1]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # jit.trace: the tracer the ONNX export uses
@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch 2.14 says the same as a FutureWarning
def test_fused_kernel_for_bf16_autocast_and_tracing(monkeypatch):
    calls = fused_calls(monkeypatch)
    q, k, v = (t.detach() for t in qkv(10))
    attention_core.attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attention_core.attention(q, k, v)
    torch.jit.trace(lambda a, b, c: attention_core.attention(a, b, c), (q, k, v), check_trace=False)
    assert calls == [10, 10, 10]


def test_dropout_acts_on_the_probabilities_in_training_only(keep_torch_threads):
    torch.set_num_threads(2)
    q, k, v = (t.detach() for t in qkv(12))
    assert attention_core.explicit_attention(q, k, v, 1.0, training=True)[0].abs().max() == 0
    torch.manual_seed(0)
    dropped = attention_core.attention(q, k, v, 0.5)
    kept = attention_core.attention(q, k, v, 0.0)
    assert max_diff(dropped, kept) > 1e-3
    out, probs = attention_core.explicit_attention(q, k, v, 0.5, training=False)
    assert max_diff(out, kept) <= 1e-6 and max_diff(probs.sum(-1), torch.ones(probs.shape[:-1])) <= 1e-6


def test_whole_model_logits_and_gradients_unchanged(monkeypatch, keep_torch_threads):
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = vitlab.create_model("custom", image_size=28, in_chans=1, patch_size=4, dim=64, depth=2, heads=4,
                                mlp_dim=128, num_classes=10)
    x = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    results = []
    for explicit in (True, False):
        monkeypatch.setattr(attention_core, "EXPLICIT_ATTENTION", explicit)
        model.zero_grad()
        logits = model(x)
        logits.square().sum().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (logits_a, grads_a), (logits_b, grads_b) = results
    assert max_diff(logits_a, logits_b) <= 1e-5
    for a, b in zip(grads_a, grads_b):
        assert max_diff(a, b) <= 1e-4 * max(1.0, float(b.abs().max()))


def fused_projection(tokens: int, batch: int = 2, heads: int = 4, head_size: int = 16, seed: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, tokens, 3 * heads * head_size, generator=gen) * 2


def views_route(qkv: torch.Tensor, heads: int, queries: int | None) -> torch.Tensor:
    """What Attention.forward computed in inference before inference_attention: the (B, H, N, hd) views."""
    b, n, three_d = qkv.shape
    q, k, v = (t.reshape(b, n, heads, three_d // 3 // heads).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    if queries is not None:
        q = q[:, :, :queries]
    out = attention_core.attention(q, k, v)
    return out.transpose(1, 2).reshape(b, out.shape[2], three_d // 3)


@pytest.mark.parametrize("tokens,queries", [(17, None), (50, None), (50, 1), (197, 1), (197, None)])
def test_inference_attention_computes_the_views_route(tokens, queries, keep_torch_threads):
    """From the fused projection: the same function as the views' route (the batched products on one copy where the
    explicit route applies: up to fp32 rounding; the fused kernel beyond: the same operators), every query shape."""
    torch.set_num_threads(2)
    qkv = fused_projection(tokens)
    with torch.inference_mode():
        ours = attention_core.inference_attention(qkv, 4, queries)
        ref = views_route(qkv, 4, queries)
    assert ours.shape == (2, queries or tokens, 64) and ours.is_contiguous()
    assert max_diff(ours, ref) <= 1e-6 * float(ref.abs().max())
    if not attention_core.explicit_attention_applies(qkv, queries or tokens):
        assert torch.equal(ours, ref)
    with torch.inference_mode(), attention_core.route_threads_pinned(1):  # one thread: the fused kernel throughout
        assert torch.equal(attention_core.inference_attention(qkv, 4, queries), views_route(qkv, 4, queries))


def test_inference_attention_takes_the_gradient_route_under_autograd(keep_torch_threads):
    """A gradient wanted through qkv (a saliency map of a model in eval mode): the views' route, which autograd
    follows, and gradients that match it."""
    torch.set_num_threads(2)
    qkv = fused_projection(50).requires_grad_()
    ours = attention_core.inference_attention(qkv, 4)
    assert ours.grad_fn is not None
    (g,) = torch.autograd.grad(ours.sum(), qkv)
    (ref_g,) = torch.autograd.grad(views_route(qkv, 4, None).sum(), qkv)
    assert max_diff(g, ref_g) <= 1e-6 * float(ref_g.abs().max())


@pytest.mark.parametrize("head_size,alpha", [(16, True), (64, True), (4, True), (32, False), (80, False)])
@pytest.mark.parametrize("tokens,queries", [(50, None), (50, 1), (80, None), (5, None)])
def test_a_power_of_two_scale_in_the_product_gives_the_multiplys_bits(head_size, alpha, tokens, queries,
                                                                      two_threads, monkeypatch):
    """The explicit route's scores (q * scale) @ k^T: with a power-of-two scale as the product's alpha (no pass
    over q), the same bits as the separate multiply; other scales keep the multiply."""
    heads = 2
    gen = torch.Generator().manual_seed(head_size + tokens)
    qkv = torch.randn(3, tokens, 3 * heads * head_size, generator=gen) * 4
    assert attention_core.explicit_attention_applies(qkv, queries or tokens)
    calls = []
    monkeypatch.setattr(torch, "baddbmm", lambda *a, **kw: calls.append(1) or torch.ops.aten.baddbmm(*a, **kw))
    with torch.inference_mode():
        ours = attention_core.inference_attention(qkv, heads, queries)
        monkeypatch.setattr(attention_core, "SCALE_IN_PRODUCT", False)
        multiply = attention_core.inference_attention(qkv, heads, queries)
    assert len(calls) == alpha  # the alpha form only where the scale is a power of two
    assert torch.equal(ours, multiply)  # which test_inference_attention_computes_the_views_route checks further
