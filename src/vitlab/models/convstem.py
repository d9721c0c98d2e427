"""The convolutional stem of Xiao et al. 2021 ("Early convolutions help transformers see better").

A stack of 3x3 stride-2 convolutions, each followed by GroupNorm and ReLU, in place of the large-kernel
patchify: the Transformer then gets tokens built from local, translation-equivariant features. Padding
1 on each side makes every convolution halve a side rounding up (28 -> 14 -> 7 -> 4), so any input size
works. GroupNorm rather than the paper's BatchNorm keeps the model independent of the batch (and of the
number of processes under DistributedDataParallel), like the BiT stem of the official hybrids.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vitlab.models.resnet import init_conv_gn_


def _groups(channels: int, most: int = 32) -> int:
    """32 groups as in BiT, or the largest divisor of `channels` below that."""
    return max(g for g in range(1, most + 1) if channels % g == 0)


class ConvStem(nn.Sequential):
    """(B, in_chans, H, W) -> (B, channels[-1], ceil(H / 2^n), ceil(W / 2^n)) for n = len(channels)."""

    def __init__(self, in_chans: int, channels: tuple[int, ...]):
        layers: list[nn.Module] = []
        for out in channels:
            layers += [nn.Conv2d(in_chans, out, 3, stride=2, padding=1, bias=False),
                       nn.GroupNorm(_groups(out), out, eps=1e-6), nn.ReLU(inplace=True)]
            in_chans = out
        super().__init__(*layers)
        self.out_channels = in_chans
        # Set by the training loop for --precision bf16-stem: the convolutions run under autocast to this
        # dtype (and the output goes back to the input's dtype) while the Transformer stays in fp32.
        self.autocast_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.autocast_dtype is None or torch.is_autocast_enabled(x.device.type):
            return super().forward(x)
        with torch.autocast(x.device.type, dtype=self.autocast_dtype):
            return super().forward(x).to(x.dtype)

    @torch.no_grad()
    def init_weights(self) -> None:
        """flax-default (lecun-normal) convolutions, GroupNorm ones/zeros: the conventions of the rest."""
        init_conv_gn_(self)
