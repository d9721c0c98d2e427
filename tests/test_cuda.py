"""The CUDA paths (issue 18, item 6): bf16 autocast, fused SDPA (flash) attention, torch.compile, DDP over NCCL,
training with checkpoint and exact resume on the GPU, in bf16 and in fp16 with loss scaling.

Skipped without a CUDA GPU (CI has none). `VITLAB_TEST_DEVICE=cpu` runs the device-independent ones on the CPU,
to check the tests themselves where no GPU is at hand. How they were run on a GPU: docs/benchmarks.md, "GPU".
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import vitlab
from test_train_lifecycle import assert_same_weights, resume_cfg, run_interrupted, tiny_cfg
from test_train_loop import tiny_data
from vitlab.train import train

DEVICE = "cuda" if torch.cuda.is_available() else os.environ.get("VITLAB_TEST_DEVICE")
pytestmark = [pytest.mark.skipif(DEVICE is None, reason="no CUDA GPU"),
              pytest.mark.usefixtures("keep_torch_threads")]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU itself")


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 as fp32: TF32 matrix products would round the inputs to 10 bits and break the 1e-4 comparisons."""
    if not torch.cuda.is_available():
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def model_with_weights(name: str, **kw) -> torch.nn.Module:
    """A named model with non-zero head and biases (its zero-initialised head would give zero logits)."""
    torch.manual_seed(0)
    model = vitlab.create_model(name, **kw)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def images(n: int, size: int = 224) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def test_fp32_on_the_gpu_matches_the_cpu():
    model, x = model_with_weights("vit-s/16", num_classes=10).eval(), images(4)
    with torch.no_grad():
        cpu = model(x)
        gpu = model.to(DEVICE)(x.to(DEVICE)).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=1e-4, atol=1e-4 * cpu.abs().max().item())


def test_bf16_autocast_forward_and_gradients_follow_fp32():
    model, x = model_with_weights("vit-s/16", num_classes=10).to(DEVICE), images(4).to(DEVICE)
    y = torch.arange(4, device=DEVICE)

    def logits_and_grads(bf16: bool):
        model.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
        F.cross_entropy(logits.float(), y).backward()
        return logits.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    ref_logits, ref_grads = logits_and_grads(False)
    logits, grads = logits_and_grads(True)
    assert logits.dtype == torch.bfloat16
    assert relative_error(logits, ref_logits) < 0.05  # bf16 keeps 8 bits of mantissa
    assert torch.isfinite(grads).all()
    assert F.cosine_similarity(grads.float(), ref_grads, dim=0) > 0.99


@needs_cuda
def test_the_fused_attention_kernel_runs_and_flash_attention_takes_the_models_tensors():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    model, x = model_with_weights("vit-b/16", num_classes=10).cuda(), images(2).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with sdpa_kernel([SDPBackend.MATH]):
            reference = model(x)
        # Flash alone: raises "No available kernel" if q, k, v (views of the fused qkv product) did not suit it
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            flash = model(x)
            flash.float().sum().backward()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(x)
            torch.cuda.synchronize()
    assert relative_error(flash, reference) < 0.05
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    kernels = " ".join(e.key.lower() for e in prof.key_averages())
    print("attention kernels:", [e.key for e in prof.key_averages() if "attention" in e.key.lower()
                                 or "flash" in e.key.lower() or "fmha" in e.key.lower()])
    assert any(name in kernels for name in ("flash", "fmha", "cudnn", "attention")), kernels[:2000]


def test_torch_compile_gives_the_eager_logits_and_trains():
    model, x = model_with_weights("vit-ti/16", num_classes=10).to(DEVICE).eval(), images(4).to(DEVICE)
    compiled = torch.compile(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    y = torch.arange(4, device=DEVICE)
    losses = []
    for _ in range(4):
        with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
            loss = F.cross_entropy(compiled(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@needs_cuda
def test_ddp_over_nccl_gives_the_single_process_gradients(tmp_path):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    # One GPU here: NCCL refuses two ranks on one device, so this is one rank; the reducer, its buckets and
    # NCCL's all-reduce still run on every gradient (counted through a comm hook that calls the default one).
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model, x = model_with_weights("vit-ti/16", num_classes=10).cuda(), images(4).cuda()
        y = torch.arange(4, device="cuda")
        F.cross_entropy(model(x), y).backward()
        plain = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        ddp = DDP(model, device_ids=[0])
        reduced = []

        def counting_allreduce(state, bucket):
            reduced.append(bucket.buffer().numel())
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counting_allreduce)
        F.cross_entropy(ddp(x), y).backward()
        assert dist.get_backend() == "nccl"
        assert sum(reduced) == sum(p.numel() for p in model.parameters())
        # The fused attention backward adds with atomics, so two backward passes agree to rounding, not bits.
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, plain[n], rtol=1e-4, atol=1e-5 * plain[n].abs().max().item(), msg=n)
    finally:
        dist.destroy_process_group()


def test_training_on_the_device_in_bf16_resumes_bit_identical(tmp_path, monkeypatch):
    """`vitlab train` on the GPU (bf16 autocast, deterministic kernels): interrupted at step 4, resumed from its
    checkpoint, it ends with the uninterrupted run's weights to the last bit (CUDA RNG state included)."""
    kw = dict(device=DEVICE, precision="bf16", deterministic=True)
    ref = train(tiny_cfg(tmp_path, name="ref", **kw), data=tiny_data())
    assert next(ref.model.parameters()).device.type == torch.device(DEVICE).type
    run = run_interrupted(tmp_path, monkeypatch, step=4, **kw)
    resumed = train(resume_cfg(run), data=tiny_data())
    assert_same_weights(ref.model, resumed.model)
    assert ref.history[-1]["train_loss"] < ref.history[0]["train_loss"]


def test_fp16_with_loss_scaling_skips_overflowing_steps_and_resumes_bit_identical(tmp_path, monkeypatch):
    """`--precision fp16` (the GPUs without bf16): autocast to fp16 and torch's GradScaler. Started at a loss scale
    of 2^24 (torch's default is 2^16), the scaled gradients overflow fp16 at first: those steps are skipped and the
    scale backs off. A run interrupted at step 4 and resumed ends with the uninterrupted run's weights to the last
    bit, which needs the checkpoint's loss scale: a resume from the initial scale would skip other steps."""
    real_scaler = torch.amp.GradScaler
    monkeypatch.setattr(torch.amp, "GradScaler", lambda *a, **kw: real_scaler(*a, init_scale=2.0 ** 24, **kw))
    kw = dict(device=DEVICE, precision="fp16", deterministic=True, epochs=3)
    ref = train(tiny_cfg(tmp_path, name="ref", **kw), data=tiny_data())
    assert ref.history[-1]["train_loss"] < ref.history[0]["train_loss"]
    scale_at = {int(p.stem.split("-")[1]): torch.load(p, weights_only=True)["scaler"]["scale"]
                for p in (tmp_path / "ref" / "checkpoints").glob("step-*.pt")}
    assert max(scale_at.values()) < 2.0 ** 24, scale_at  # overflowing steps were skipped and the scale backed off
    run = run_interrupted(tmp_path, monkeypatch, step=4, **kw)
    resumed = train(resume_cfg(run), data=tiny_data())
    assert_same_weights(ref.model, resumed.model)


def test_training_with_compile_on_the_device(tmp_path):
    result = train(tiny_cfg(tmp_path, device=DEVICE, precision="bf16", compile=True, epochs=3), data=tiny_data())
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]


def test_the_cli_trains_under_torchrun_on_the_device(tmp_path):
    args = ["--recipe", "small-data", "--data", "digits", "--per-class", "16", "--model", "custom",
            "--model-args", "dim=32,depth=2,heads=2,mlp_dim=64,patch_size=2", "--batch-size", "32", "--steps", "6",
            "--warmup-steps", "1", "--no-inception-crop", "--seed", "1", "--quiet", "--ckpt-every", "3",
            "--device", DEVICE, "--out", str(tmp_path), "--name", "cli"]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                          "-m", "vitlab", "train", *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "cli" / "model" / "model.safetensors").exists()
    assert list((tmp_path / "cli" / "checkpoints").glob("step-*.pt"))


def test_a_model_evaluated_on_the_device_can_then_be_fine_tuned():
    """`vitlab compare` evaluates each model zero-shot, then fine-tunes it. The evaluation moved the CPU model to
    the GPU inside inference_mode, which made its parameters inference tensors that training cannot use (found
    on an H200; on the CPU `.to` keeps the same tensors)."""
    from vitlab.data import Preprocess
    from vitlab.evaluate.features import run_model

    model = vitlab.create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=2, image_size=8,
                                in_chans=1, num_classes=3)
    out = run_model(model, tiny_data().test, Preprocess(image_size=(8, 8), mean=(0.5,), std=(0.5,), channels=1),
                    device=DEVICE, progress=False)
    assert out.logits.shape == (24, 3)
    assert not any(p.is_inference() for p in model.parameters())
    x, y = torch.randn(4, 1, 8, 8, device=DEVICE), torch.arange(4, device=DEVICE) % 3
    F.cross_entropy(model(x), y).backward()
    assert all(p.grad is not None for p in model.parameters())
