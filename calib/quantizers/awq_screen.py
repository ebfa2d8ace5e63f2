"""AWQ's screened search (`--awq-search screen`, `packers/awq.screen_grid`): the inspected
block copied to bfloat16, to score every ratio cheaply before the close ones are scored
again in float32.

On a CPU the copy's attention runs as `screen_attention` (batched matmuls and a softmax
in reused buffers) instead of torch's fused sdpa kernel, which gains nothing from
bfloat16 there (`benchmarks/awq_search.py --search screen` times the search against the full grid).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from infer_tool.calib.layers import LayerCall, first, set_weight_nk

SCREEN_DTYPE = torch.bfloat16  # the screened search's block precision
SCREEN_ATTENTION = "infer_tool_bf16_screen"  # its name among transformers' attention functions


def native_low_precision(device: torch.device) -> bool:
    """Whether `device` multiplies SCREEN_DTYPE matrices natively (a CPU: oneDNN's bf16)."""
    return torch.cuda.is_bf16_supported() if device.type == "cuda" else torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _to(obj: Any, dtype: torch.dtype) -> Any:
    """Every floating tensor in a nest of tuples, lists and dicts cast to `dtype`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, dtype) for k, v in obj.items()}
    return obj


def low_precision_block(
    module: nn.Module, balance: list[nn.Module], calls: list[LayerCall], conv1d: bool
) -> Callable[[list[torch.Tensor]], torch.Tensor] | None:
    """The inspected block in bfloat16, for AWQ's screened search: a copy of `module` and of
    its calls cast to SCREEN_DTYPE; forward(effective) puts the effective weights (the
    order of `balance`) into the copy's balanced linears and returns the block outputs of
    every call, concatenated. None where the device has no native bfloat16 matmul, a
    balanced linear is not inside the block, or a submodule's forward is patched on the
    instance (an accelerate hook, a test's mask): a copy would still call the original."""
    device = next(module.parameters()).device
    names = {id(sub): name for name, sub in module.named_modules()}
    patched = any("forward" in m.__dict__ for m in module.modules())
    if not native_low_precision(device) or patched or any(id(b) not in names for b in balance):
        return None
    low = copy.deepcopy(module).to(SCREEN_DTYPE)
    for sub in low.modules():  # the copy's own config (deepcopy): its attention runs as `screen_attention`
        config = getattr(sub, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) == "sdpa" and device.type == "cpu":
            config._attn_implementation = screen_attention_name()
    targets = [low.get_submodule(names[id(b)]) for b in balance]
    cast = [LayerCall(_to(c.args, SCREEN_DTYPE), _to(c.kwargs, SCREEN_DTYPE)) for c in calls]

    def forward(effective: list[torch.Tensor]) -> torch.Tensor:
        for b, w in zip(targets, effective):
            set_weight_nk(b, w.to(SCREEN_DTYPE), conv1d)
        with torch.no_grad():
            return torch.cat([first(low(*c.args, **c.kwargs)) for c in cast])

    return forward


def screen_attention_name() -> str:
    """Register `screen_attention` with transformers' attention functions, with sdpa's masks
    (once); its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if SCREEN_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(SCREEN_ATTENTION, screen_attention)
        AttentionMaskInterface.register(SCREEN_ATTENTION, sdpa_mask)
    return SCREEN_ATTENTION


def screen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention as plain batched matmuls and a softmax, for the bfloat16
    screen on a CPU: there torch's fused kernel gains nothing from bfloat16, while a bfloat16
    matmul does. The (B·H, Lq, Lk) scores and probabilities live in buffers kept on the module
    per shape and reused by every candidate (a fresh one costs a page fault per 4 KiB).
    query (B, H, Lq, D), key/value
    (B, Hkv, Lk, D or Dv); returns ((B, Lq, H, Dv), None) like sdpa. A call that sdpa treats
    otherwise (dropout, softcap, position bias, sinks), or not on a CPU, goes to sdpa itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    special = any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "s_aux", "sinks"))
    if dropout or special or query.device.type != "cpu":
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    B, H, q_len, _ = query.shape
    groups = H // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    k_len = key.shape[2]
    causal = (
        q_len > 1
        and attention_mask is None
        and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    )
    buffers = module.__dict__.setdefault("_screen_buffers", {})

    def buffer(name: str, shape: tuple[int, ...], fill: Callable[[torch.Tensor], Any] | None = None) -> torch.Tensor:
        if (name, shape, query.dtype) not in buffers:
            buffers[name, shape, query.dtype] = t = torch.empty(shape, dtype=query.dtype, device=query.device)
            if fill is not None:
                fill(t)
        return buffers[name, shape, query.dtype]

    if causal:  # sdpa's is_causal: query i sees keys 0..i (upper-left aligned)
        bias = buffer("causal", (q_len, k_len), lambda t: t.fill_(float("-inf")).triu_(1))
    elif attention_mask is not None:  # bool: True = attend (sdpa's masks); else additive
        mask = (
            attention_mask
            if attention_mask.dtype != torch.bool
            else torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
                ~attention_mask, float("-inf")
            )
        )
        bias = mask.to(query.dtype).expand(B, H, q_len, k_len).reshape(B * H, q_len, k_len)
    else:
        bias = buffer("zero", (q_len, k_len), lambda t: t.zero_())
    scores = torch.baddbmm(
        bias,
        query.reshape(B * H, q_len, -1),
        key.reshape(B * H, k_len, -1).transpose(1, 2),
        alpha=query.shape[-1] ** -0.5 if scaling is None else scaling,
        out=buffer("scores", (B * H, q_len, k_len)),
    )
    probs = torch.ops.aten._softmax.out(scores, -1, False, out=buffer("probs", (B * H, q_len, k_len)))
    if attention_mask is not None:  # a query that sees no key (padding): sdpa outputs 0, softmax NaN
        probs.nan_to_num_(0.0)
    out = torch.bmm(probs, value.reshape(B * H, k_len, -1)).view(B, H, q_len, -1)
    return out.transpose(1, 2).contiguous(), None
