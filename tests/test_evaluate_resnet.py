"""The ViT code's post-activation BiT ResNets (bit-rNxW-postact; the old "resnet-N" names): parameter counts,
small stem, weight standardisation, zero-init, training."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vitlab.models import create_model
from vitlab.models.registry import count_parameters
from vitlab.models.resnet import Bottleneck, StdConv2dSame


@pytest.mark.parametrize("name,params", [
    ("bit-r50x1-postact", 25_557_032),   # torchvision resnet50
    ("bit-r101x1-postact", 44_549_160),  # torchvision resnet101
    ("bit-r152x1-postact", 60_192_808),  # torchvision resnet152
])
def test_parameter_counts_match_torchvision(name, params):
    # GroupNorm has the same weight+bias as BatchNorm and the convolutions have no bias in both.
    with torch.device("meta"):
        model = create_model(name, num_classes=1000)
    assert count_parameters(model) == params


def test_width_factor_scales_channels():
    with torch.device("meta"):
        model = create_model("bit-r50x2-postact", num_classes=10)
    assert model.num_features == 4096 and model.stem.conv.out_channels == 128


def test_small_stem_on_28px():
    # one unit per stage keeps the test fast; the stem and the stage strides are resnet-50's
    model = create_model("bit-r50x1-postact-small", num_classes=10, image_size=28, in_chans=1, seed=0, layers=(1, 1, 1, 1)).eval()
    assert model.stem.conv.kernel_size == (3, 3) and model.stem.conv.stride == (1, 1)
    x = torch.randn(1, 1, 28, 28)
    with torch.no_grad():
        assert model.stem(x).shape == (1, 64, 28, 28)  # no max-pool, no stride
        # stages: stride 1, 2, 2, 2 with 'SAME' padding: 28 -> 28 -> 14 -> 7 -> 4
        assert model.forward_features(x).shape == (1, 2048, 4, 4)
        assert model(x).shape == (1, 10)
    # the paper's stem on the same input: 7x7/2 conv + 3x3/2 pool -> 7, then 7 -> 4 -> 2 -> 1
    big = create_model("bit-r50x1-postact", num_classes=10, image_size=28, in_chans=1, seed=0, layers=(1, 1, 1, 1)).eval()
    with torch.no_grad():
        assert big.forward_features(x).shape == (1, 2048, 1, 1)


def test_weight_standardisation_against_numpy():
    torch.manual_seed(0)
    conv = StdConv2dSame(3, 8, 7, stride=2)
    with torch.no_grad():
        conv.weight.mul_(3).add_(0.5)
    w = conv.weight.detach().numpy().astype(np.float64)
    flat = w.reshape(8, -1)
    ws = (flat - flat.mean(1, keepdims=True)) / (flat.std(1, keepdims=True) + 1e-5)  # population std
    np.testing.assert_allclose(conv.standardized_weight().detach().numpy(), ws.reshape(w.shape), rtol=1e-5, atol=1e-6)
    # forward: TF 'SAME' for 28 px, kernel 7, stride 2 -> 14 outputs, total pad 5 = 2 before + 3 after
    x = torch.randn(1, 3, 28, 28)
    ref = F.conv2d(F.pad(x, (2, 3, 2, 3)), torch.tensor(ws.reshape(w.shape), dtype=torch.float32), stride=2)
    out = conv(x)
    assert out.shape == (1, 8, 14, 14)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_last_groupnorm_of_each_unit_is_zero_initialised():
    with torch.device("meta"):
        assert sum(isinstance(m, Bottleneck) for m in create_model("bit-r50x1-postact").modules()) == 3 + 4 + 6 + 3
    model = create_model("bit-r26x1-postact", num_classes=10, image_size=32, seed=0, layers=(2, 2))
    units = [m for m in model.modules() if isinstance(m, Bottleneck)]
    assert len(units) == 4
    for u in units:
        assert torch.count_nonzero(u.norm3.weight) == 0
        assert torch.all(u.norm1.weight == 1) and torch.all(u.norm2.weight == 1)
        # so a unit without projection starts as the identity (then ReLU)
        if u.downsample is None:
            x = torch.relu(torch.randn(1, u.conv1.in_channels, 4, 4))
            with torch.no_grad():
                torch.testing.assert_close(u(x), x)
    assert torch.count_nonzero(model.head.weight) == 0  # zero-initialised head


def test_small_resnet_trains():
    torch.manual_seed(0)
    model = create_model("bit-r26x1-postact-small", num_classes=3, image_size=8, in_chans=1, layers=(1,), seed=0)
    x = torch.randn(6, 1, 8, 8)
    y = torch.arange(6) % 3
    x = x + y.view(-1, 1, 1, 1).float()  # learnable: the class shifts the mean
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(np.log(3), rel=1e-4)  # zero head: uniform prediction
    assert losses[-1] < 0.5 * losses[0]
