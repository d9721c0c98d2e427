"""In CPU fp32 inference a plain ViT's patch convolution runs as a product of patches where that is the faster
(PatchEmbed._inference_product): the tokens are torch's convolution's within float rounding, and the convolution
stays wherever the product would hide or change something (autograd, a hook, a replaced or different convolution,
shapes where the convolution is the faster)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import vitlab
from vitlab.engine.torch_engines import TorchEngine
from vitlab.models import fast_linear, vit


def tiny_vit(**kw):
    cfg = dict(image_size=32, patch_size=8, dim=32, depth=1, heads=4, mlp_dim=48, num_classes=5, seed=0) | kw
    return vitlab.create_model("custom", **cfg).eval()


@pytest.fixture
def products(monkeypatch):
    """The weights `fast_linear.product` was called with, in order."""
    seen = []
    real = fast_linear.product

    def spy(x, weight, bias):
        seen.append(weight)
        return real(x, weight, bias)

    monkeypatch.setattr(fast_linear, "product", spy)
    return seen


def tokens_by_convolution(model, images):
    vit.PATCH_PRODUCT = False
    try:
        with torch.no_grad():
            return model.patch_embed(images)[0]
    finally:
        vit.PATCH_PRODUCT = True


@pytest.mark.parametrize("kw, batch", [
    (dict(), 1),                                      # 16 patches of 8 px: few rows
    (dict(image_size=64, patch_size=32), 6),          # 32-px patches: at any batch
    (dict(image_size=28, patch_size=4, in_chans=1), 1),  # the Fashion-MNIST shape
    (dict(image_size=(32, 48), patch_size=16), 2),    # not square
])
def test_the_product_gives_the_convolutions_tokens(products, kw, batch):
    model = tiny_vit(**kw)
    with torch.no_grad():
        model.patch_embed.proj.bias.normal_()
    cfg = model.config
    images = torch.randn(batch, cfg.in_chans, *cfg.image_size)
    with torch.no_grad():
        tokens, grid = model.patch_embed(images)
    assert products == [model.patch_embed.proj.weight]
    reference = tokens_by_convolution(model, images)
    assert grid == cfg.grid_for(cfg.image_size)
    assert tokens.shape == reference.shape
    torch.testing.assert_close(tokens, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))


def test_the_engine_uses_its_packed_copy_and_gives_the_convolutions_logits(products):
    model = tiny_vit(image_size=64, patch_size=32)  # 4 x 3072 x 32 multiply-accumulates: a oneDNN product
    with torch.no_grad():
        model.head.weight.normal_()
    engine, images = TorchEngine(model), torch.randn(1, 3, 64, 64)
    logits = engine(images)
    vit.PATCH_PRODUCT = False
    try:
        by_convolution = engine(images)
    finally:
        vit.PATCH_PRODUCT = True
    torch.testing.assert_close(logits, by_convolution, rtol=1e-5, atol=1e-5 * float(by_convolution.abs().max()))
    weight = model.patch_embed.proj.weight
    assert engine.packed._packs.get(weight) is not None  # packed as the (out, in * 32 * 32) matrix
    assert products and all(w is weight for w in products)


def test_the_convolution_stays_for_16_pixel_patches_of_several_images(products):
    model = tiny_vit(image_size=224, patch_size=16, dim=16, heads=2, mlp_dim=16)
    with torch.no_grad():
        model.patch_embed(torch.randn(2, 3, 224, 224))  # 392 patches: more than PATCH_PRODUCT_MAX_ROWS
        assert products == []
        model.patch_embed(torch.randn(1, 3, 224, 224))
    assert len(products) == 1


def test_autograd_keeps_the_convolution_and_its_gradients(products):
    model = tiny_vit()
    images = torch.randn(1, 3, 32, 32)
    model(images).sum().backward()
    assert products == []
    model.zero_grad()
    model.patch_embed.proj.weight.requires_grad_(False)  # bias-only fine-tuning (BitFit)
    model(images).sum().backward()
    assert products == []
    assert model.patch_embed.proj.bias.grad is not None


def test_a_hook_on_the_convolution_still_sees_it_run(products):
    model = tiny_vit()
    calls = []
    model.patch_embed.proj.register_forward_hook(lambda m, args, out: calls.append(out.shape))
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    assert calls == [torch.Size([1, 32, 4, 4])]
    assert products == []


@pytest.mark.parametrize("conv", [
    lambda: nn.Conv2d(3, 32, 8, stride=8, padding=1),
    lambda: nn.Conv2d(3, 32, 8, stride=4),
    lambda: nn.Conv2d(3, 32, 8, stride=8, dilation=1, groups=1).double(),
])
def test_a_convolution_that_is_not_a_plain_cut_into_patches_runs_as_itself(products, conv):
    model = tiny_vit()
    model.patch_embed.proj = conv()
    images = torch.randn(1, 3, 32, 32).to(model.patch_embed.proj.weight.dtype)
    with torch.no_grad():
        expected = model.patch_embed.proj(images)
        tokens = model.patch_embed(images)[0]
    assert products == []
    torch.testing.assert_close(tokens, expected.flatten(2).transpose(1, 2))


def test_the_packed_and_the_plain_product_give_the_same_logits(products, monkeypatch):
    """The engine's packed weight and the plain call's (out, in * p * p) view of the convolution's weight: the same
    oneDNN product. The logits are the same to the bit on the AMD EPYC this project runs on (as for the linear
    layers, benchmarks/packed_weights.py) but differed in the last bits on the H200 machine's CPU, where oneDNN's
    kernel for a layout packed ahead of the call is not the one it picks inside the call: fp32 rounding, then."""
    from vitlab.engine import torch_engines

    monkeypatch.setattr(torch_engines, "ONE_THREAD_MAX_FLOPS", 0)  # both calls on the same threads
    model = tiny_vit(image_size=64, patch_size=32)
    with torch.no_grad():
        model.head.weight.normal_()
    images = torch.randn(1, 3, 64, 64)
    packed = TorchEngine(model)(images)
    with torch.inference_mode():
        plain = model(images)
    assert len(products) == 2
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5 * float(plain.abs().max()))
