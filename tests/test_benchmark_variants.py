"""benchmarks/ort_variants.py's alternatives stay the same model as vitlab's (they are timed against it, so a
variant that computes something else, or no longer runs, would make docs/benchmarks.md's table meaningless)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("onnxruntime")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ort_variants  # noqa: E402

from test_engine import images, tiny  # noqa: E402
from vitlab.engine.ort import OrtEngine, build_fp32  # noqa: E402


def test_the_first_block_fused_variant_is_the_same_model(tmp_path):
    import types

    from vitlab.engine import onnx_graph

    model = tiny()
    x = images(3)
    twin = copy.deepcopy(model)
    twin.embed = types.MethodType(ort_variants._embed_subtracting, twin)
    with torch.no_grad():
        assert torch.equal(twin.embed(x), model.embed(x))  # x - (-p) is x + p to the bit
        ref = model(x)
    real = onnx_graph.fusable_copy
    out = OrtEngine(ort_variants.first_block_fused(model, tmp_path, (32, 32)), 1)(x)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert onnx_graph.fusable_copy is real  # vitlab's own export is left as it was


def test_ort_quantize_static_variant_runs_and_approximates_the_model(tmp_path):
    model = tiny()
    fp32 = build_fp32(model, tmp_path, (32, 32))
    calibration = [images(16, seed=s).numpy() for s in (2, 3)]
    x = images(4)
    out = OrtEngine(ort_variants.qdq_static(fp32, tmp_path / "qdq.onnx", calibration), 1)(x)
    with torch.no_grad():
        ref = model(x)
    assert (out - ref).abs().max() < 0.15 * ref.abs().max()


def test_kernel_breakdown_of_both_engines_runs(tmp_path, capsys):
    """`benchmarks/overhead.py --kernels`: each engine's per-operator time and one block's products alone."""
    import overhead

    model = tiny()
    overhead.kernels(model, 32, threads=1, calls=2)
    out = capsys.readouterr().out
    assert "torch (torch.profiler" in out and "onnxruntime (ORT's profiler" in out
    assert "MatMul" in out and "qkv" in out and "fc2" in out
    times = ort_variants.op_times(build_fp32(model, tmp_path, (32, 32)), images(2).numpy(), 1, runs=2)
    assert times and all(ms > 0 for ms in times.values())


def test_idle_ops_times_six_ops_after_each_gap(capsys):
    """`benchmarks/overhead.py --idle-ops`: the 1st..6th op after each idle gap, per thread count."""
    import overhead

    assert len(overhead.us_of_ops_after_idle(0.0, repeats=2)) == 6
    overhead.idle_ops([1], gaps=(0.0, 0.001))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("threads 1")]
    assert len(lines) == 2 and all(len(line.split(":")[1].split()) == 6 for line in lines)


def test_cold_ops_times_each_wait_and_restores_the_threads(capsys):
    """`benchmarks/overhead.py --cold-ops`: the 1st..4th op and a call of each engine after each kind of wait."""
    import overhead

    before = torch.get_num_threads()
    overhead.cold_ops(repeats=1)
    assert torch.get_num_threads() == before
    lines = capsys.readouterr().out.splitlines()
    for wait in overhead.WAITS:
        ops = [line for line in lines if line.strip().startswith(wait) and "50 x" in line]
        assert len(ops) == 2 and all(len(line.split("192" if "addmm" in line else "128")[-1].split()) == 4
                                     for line in ops)
        assert any(line.strip().startswith(wait) and "torch" in line and "onnxruntime" in line for line in lines)


def test_small_calls_times_both_thread_counts_and_restores_the_rule(capsys):
    """`benchmarks/overhead.py --small-calls`: one thread against all per (model, batch, gap), with the rule's pick;
    its rows set the engine's limit for their own calls only."""
    import overhead

    from vitlab.engine import torch_engines

    before = torch.get_num_threads()
    limit = torch_engines.ONE_THREAD_MAX_FLOPS
    try:
        overhead.small_calls(2, 1, [("fmnist", 1), ("fmnist", 4)], gaps=(0.0,))
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert torch_engines.ONE_THREAD_MAX_FLOPS == limit
    assert "fmnist     batch   1" in out and "rule picks: 1 thread" in out  # 23.6 MFLOP
    assert "fmnist     batch   4" in out and "rule picks: 2 threads" in out  # 94.4 MFLOP


def test_linear_small_times_both_routes_and_restores_the_rule(capsys, monkeypatch):
    """`benchmarks/linear.py --small`: each small product through oneDNN and F.linear with the rule's pick, then
    whole models with the rule off and on; the rule's limits are as shipped afterwards."""
    import linear

    from vitlab.models import fast_linear

    shipped = fast_linear.SMALL_PRODUCT_MACS, fast_linear.SMALL_FEW_ROW_PRODUCT_MACS
    monkeypatch.setattr(linear, "PAUSE_S", 0.0)
    linear.small_products(rounds=1, calls=1)
    linear.small_rule_models(rounds=1)
    out = capsys.readouterr().out
    assert (fast_linear.SMALL_PRODUCT_MACS, fast_linear.SMALL_FEW_ROW_PRODUCT_MACS) == shipped
    assert "50 x   64 ->  192" in out and out.count("F.linear\n") >= 5 and out.count("oneDNN\n") >= 5
    assert "Fashion-MNIST ViT  batch   1" in out and "vit-ti/16" in out


def test_patch_embed_times_both_routes_and_restores_the_switch(monkeypatch):
    """`benchmarks/patch_embed.py`: the embedding alone and a whole model, the convolution and the product; the
    product route is on again afterwards, and the two give tokens within float rounding of each other."""
    import patch_embed

    from vitlab.engine import choose
    from vitlab.models import vit

    monkeypatch.setattr(choose, "PAUSE_S", 0.0)
    conv, product, diff = patch_embed.projection_alone("fmnist", 1, rounds=1)
    assert conv > 0 and product > 0 and diff < 1e-5
    speeds = patch_embed.whole_model("fmnist", 2, rounds=1)
    assert all(s > 0 for s in speeds)
    assert vit.PATCH_PRODUCT is True


def test_direct_inference_attempts_still_run_and_the_fused_add_keeps_the_logits(monkeypatch):
    """`benchmarks/direct_inference.py --attempts`: the variants follow the direct route's plan as it is now (its
    weights are (oneDNN, plain) pairs), and the fused residual add gives the kept route's logits to the bit."""
    import direct_inference

    from vitlab.engine import choose
    from vitlab.models import vit_direct

    monkeypatch.setattr(choose, "PAUSE_S", 0.0)
    speeds, diffs = direct_inference.attempts("vit-ti/16", rounds=1)  # oneDNN products: the post-op runs
    assert set(speeds) == {"direct", "fused residual add", "explicit core at 197 tokens", "native fused attention",
                           "views' attention"}
    assert diffs["fused residual add"] == 0.0
    assert diffs["views' attention"] < 1e-5  # the route inference_attention replaced (ViT-Ti/16: its fused kernel)
    assert diffs["native fused attention"] < 1e-4  # the same function up to fp32 rounding
    assert vit_direct._block is direct_inference.KEPT_BLOCK


def test_direct_inference_plan_check_times_the_check_of_a_built_plan(monkeypatch):
    """`benchmarks/direct_inference.py --plan-check`: the check it times is the one a direct call makes, on a plan
    that was built (an empty plan would return at once and time nothing)."""
    import direct_inference

    from vitlab.models import vit_direct

    calls = []
    real = vit_direct.DirectInference._current

    def counted(self, x, class_token_only):
        plan = real(self, x, class_token_only)
        calls.append(len(plan))
        return plan

    monkeypatch.setattr(vit_direct.DirectInference, "_current", counted)
    hot, after_call, call_ms = direct_inference.plan_check("fmnist", samples=3)
    assert hot > 0 and after_call > 0 and call_ms > 0
    assert calls and set(calls) == {direct_inference.FMNIST["depth"]}


def test_batch1_gap_rows_compute_the_same_and_every_part_runs(monkeypatch, capsys, tmp_path):
    """`benchmarks/batch1_gap.py`: its torch and ORT rows compute the same layers and the same attention (else the
    ratios it prints compare different work), every part prints its lines, and the block timer is taken off again."""
    import batch1_gap

    from vitlab.engine import choose
    from vitlab.models import vit_direct

    monkeypatch.setattr(choose, "PAUSE_S", 0.001)
    model = tiny()
    rows, flops = batch1_gap.linear_rows(model, 1)
    with torch.inference_mode():
        eager, mlas = rows["oneDNN packed"](), rows["MLAS"]()
    assert flops > 0 and len(eager) == len(mlas) == 4 * len(model.blocks)
    assert all((e - torch.from_numpy(m)).abs().max() < 1e-4 for e, m in zip(eager, mlas))
    attention = batch1_gap.attention_rows(model, 1)
    with torch.inference_mode():
        core = attention["torch fused kernel"]()
    b, h, n, d = core.shape
    fused = torch.from_numpy(attention["ORT Attention"]())
    assert (core.transpose(1, 2).reshape(b, n, h * d) - fused).abs().max() < 1e-5
    alone = torch.from_numpy(attention["ORT MultiHeadAttention"]())  # the core alone: the same attention
    assert (core.transpose(1, 2).reshape(b, n, h * d) - alone).abs().max() < 1e-5
    rows = batch1_gap.gelu_rows(model, 1, tmp_path)
    with torch.inference_mode():
        logits = {name: torch.from_numpy(fn()[0]) if name.startswith("ORT") else fn() for name, fn in rows.items()}
    for gelu in ("tanh", "exact"):  # each engine computes the same function, and the two functions differ
        assert (logits[f"eager, {gelu} GELU"] - logits[f"ORT, {gelu} GELU"]).abs().max() < 1e-4
    assert (logits["eager, tanh GELU"] - logits["eager, exact GELU"]).abs().max() > 1e-6
    block = vit_direct._block
    batch1_gap.pause(model, 1, rounds=1, tmp=tmp_path)
    batch1_gap.products(model, 1, rounds=1)
    batch1_gap.attention(model, 1, rounds=1)
    batch1_gap.gelu(model, 1, rounds=1, tmp=tmp_path)
    batch1_gap.unary(rounds=1)
    out = capsys.readouterr().out
    assert vit_direct._block is block
    assert "back to back" in out and "after 1 ms idle" in out and "oneDNN / MLAS speed" in out
    assert "attention core" in out and "sigmoid" in out and "tanh costs" in out
    blocks = [float(line.split("(blocks")[1].split(",")[0]) for line in out.splitlines() if "(blocks" in line]
    assert len(blocks) == 2 and all(ms > 0 for ms in blocks)  # the direct route ran and the timer saw its blocks


def test_attention_scale_times_both_forms_with_the_same_logits_and_restores_the_switch(monkeypatch):
    """`benchmarks/attention_scale.py`: both forms of the explicit route's scale run and give the same logits."""
    import attention_scale

    from vitlab.engine import choose
    from vitlab.models import attention_core

    monkeypatch.setattr(choose, "PAUSE_S", 0.0)
    line = attention_scale.compare("fmnist", 2, rounds=1)
    assert "max |logit difference| 0.0e+00" in line and line.count("alpha") == 2
    assert attention_core.SCALE_IN_PRODUCT is True
