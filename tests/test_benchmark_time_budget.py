"""benchmarks/time_budget.py: the FLOPs it divides by are the model's (counted here by torch's own FlopCounterMode,
not by the script's formula), and the alternative forms it times compute the same attention core and patch
embedding as the model (docs/benchmarks.md compares their speed as equals)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import time_budget  # noqa: E402

import vitlab  # noqa: E402


def small_vit():
    return vitlab.create_model("custom", image_size=32, patch_size=8, dim=64, depth=3, heads=4, mlp_dim=96,
                               num_classes=7, seed=0).eval()


def test_flops_match_torchs_count_with_the_class_token_only_last_block(monkeypatch):
    from vitlab.models import attention_core
    from vitlab.models.attention_core import explicit_attention

    # the core as its two products and a softmax, which torch's counter sees (it does not count the fused CPU kernel);
    # inference reaches it through attention_core.inference_attention
    monkeypatch.setattr(attention_core, "attention", lambda q, k, v, drop: explicit_attention(q, k, v, drop)[0])
    model = small_vit()
    counter = FlopCounterMode(display=False)
    with torch.no_grad():
        tokens = model.embed(torch.randn(1, 3, 32, 32))
        with counter:  # the blocks alone, the last for the class token alone (as model(x) runs them unwatched)
            model.encode(tokens, False, True)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    products = sum(n for op, n in counts.items() if op in ("aten.mm", "aten.addmm"))
    attention = sum(n for op, n in counts.items() if "attention" in op or op == "aten.bmm")
    assert products and attention
    ours = time_budget.model_flops(model.config, tokens=17)
    assert ours["linear layers"] == products
    assert ours["attention core"] == attention


@pytest.mark.parametrize("batch", [1, 2])
def test_every_attention_form_computes_the_fused_kernels_result(batch):
    torch.manual_seed(0)
    forms = time_budget.attention_forms(batch, heads=3, tokens=11, head_dim=8)
    reference = forms["fused kernel (torch SDPA)"]()
    for label, run in forms.items():
        out = run()
        if isinstance(out, list):  # per (image, head) or per image: put back into (B, H, N, d)
            if out[0].dim() == 2:
                out = torch.stack(out).reshape(reference.shape)
            else:
                out = torch.cat(out).reshape(batch, 3, 8, 11).transpose(-2, -1)
        assert (out - reference).abs().max() < 1e-5, label


def test_patch_forms_compute_the_models_patch_embedding():
    model = small_vit()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        reference = model.patch_embed(x)[0]
        for label, run in time_budget.patch_forms(model, x).items():
            assert (run() - reference).abs().max() < 1e-5, label


def test_budget_and_alternatives_print_every_part(capsys, monkeypatch):
    model = small_vit()
    monkeypatch.setattr(time_budget.vitlab, "create_model", lambda name: model)
    time_budget.budget("small", batch=1, calls=1, forms=True)
    out = capsys.readouterr().out
    for part in ("linear layers", "attention core", "GFLOP/s", "fused kernel (torch SDPA)", "grouped 1x1",
                 "unfold + one oneDNN product"):
        assert part in out, part
