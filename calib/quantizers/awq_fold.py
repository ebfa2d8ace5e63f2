"""AWQ's one apply step: a scale s folded into the smoothing module and the balanced
linears, leaving the block's function unchanged (dense blocks and MoE blocks alike)."""

from __future__ import annotations

import torch
from torch import nn

from infer_tool.calib.architectures import Architecture, AWQMapping
from infer_tool.calib.layers import set_weight_nk, weight_nk


def smooth_channels(smooth: nn.Module, arch: Architecture) -> int:
    """Output channels of the smoothing module (a linear's N, a norm's width)."""
    if isinstance(smooth, nn.Linear) or arch.conv1d and smooth.weight.dim() == 2:
        return int(weight_nk(smooth, arch.conv1d).shape[0])
    return int(smooth.weight.numel())


@torch.no_grad()
def fold_scales(
    smooth: nn.Module, balance: list[nn.Module], s: torch.Tensor, mapping: AWQMapping, arch: Architecture
) -> None:
    """Divide `smooth`'s output channels (its `part` slice for a fused linear) by s (K,) and
    multiply the balance linears' input columns by s; the block's function is unchanged.
    A norm computing x·(1 + w) (`arch.norm_offset` 1) gets (1 + w)/s − 1."""
    s = s.to(balance[0].weight.device).float()
    K = s.numel()
    if isinstance(smooth, nn.Linear) or arch.conv1d and smooth.weight.dim() == 2:
        W = weight_nk(smooth, arch.conv1d).detach().float().clone()  # (N, K_in)
        i = mapping.part[0] if mapping.part else 0
        W[i * K : (i + 1) * K] /= s.view(-1, 1)
        set_weight_nk(smooth, W, arch.conv1d)
        if getattr(smooth, "bias", None) is not None:
            smooth.bias[i * K : (i + 1) * K] /= s.to(smooth.bias.dtype)
    else:
        w = smooth.weight
        w.copy_(((w.float() + arch.norm_offset) / s - arch.norm_offset).to(w.dtype))
        if getattr(smooth, "bias", None) is not None:
            smooth.bias.copy_((smooth.bias.float() / s).to(smooth.bias.dtype))
    for b in balance:
        set_weight_nk(b, weight_nk(b, arch.conv1d).float() * s.view(1, -1), arch.conv1d)
