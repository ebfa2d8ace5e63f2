"""Per-architecture knowledge the calibration pipeline needs, as ONE table keyed by HF `model_type`.

For each architecture:
- `layers`: dotted path of the decoder-layer list from the top-level causal-LM module;
- `groups`: the linears of one decoder layer in true-sequential order; the linears of a
  group read the same input tensor (so they share one Hessian), and a later group sees
  the quantized output of the earlier ones (GPTQ's "true-sequential");
- `mappings`: AWQ smoothing (Lin et al. 2023, §3.2), as in llm-compressor's
  `transform/awq/mappings.py`: the `smooth` module (a norm, or a linear) whose output
  channels are divided by s, the `balance` linears whose input columns are multiplied by
  s, and the `inspect` module whose output is the search loss. `part=(i, n)` says that
  only the i-th of n equal slices of a fused smooth linear's output feeds the balance
  layer (v of a fused qkv, up of a fused gate_up). A mapping whose shapes do not line up
  (v_proj -> o_proj under GQA, where v has fewer outputs than o has inputs) is skipped at
  run time, as AutoAWQ and llm-compressor do;
- `norm_offset`: 1.0 where the RMSNorm multiplies by (1 + weight) (Gemma), so folding
  1/s gives weight' = (1 + weight) / s - 1;
- `no_clip`: linears the AWQ clip search skips (their outputs feed q·kᵀ, where clipping
  errors are amplified; AutoAWQ skips q/k too);
- `conv1d`: GPT-2's `Conv1D` stores its weight transposed, (K, N).

Module paths inside a decoder layer are relative to that layer. This module knows
nothing about solvers or file formats; adding an architecture means adding one entry
(and, when a configuration of it is not covered, a refusal in `check_model`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infer_tool.common.errors import BadInput


@dataclass(frozen=True)
class AWQMapping:
    smooth: str
    balance: tuple[str, ...]
    inspect: str
    part: tuple[int, int] | None = None  # (i, n): i-th of n equal output slices of `smooth`


@dataclass(frozen=True)
class Architecture:
    layers: str
    groups: tuple[tuple[str, ...], ...]
    mappings: tuple[AWQMapping, ...]
    norm_offset: float = 0.0
    no_clip: tuple[str, ...] = ()
    conv1d: bool = False

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for group in self.groups for name in group)


_LLAMA = Architecture(
    layers="model.layers",
    groups=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    ),
    mappings=(
        AWQMapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
        AWQMapping("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
        AWQMapping("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        AWQMapping("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ),
    no_clip=("self_attn.q_proj", "self_attn.k_proj"),
)

# Gemma 2/3: the MLP reads `pre_feedforward_layernorm`; `post_attention_layernorm` normalises
# the attention output (after o_proj) and feeds no linear.
_GEMMA = Architecture(
    layers="model.layers",
    groups=_LLAMA.groups,
    mappings=(
        AWQMapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
        AWQMapping("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
        AWQMapping("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        AWQMapping("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ),
    norm_offset=1.0,
    no_clip=_LLAMA.no_clip,
)

# Phi-3: fused qkv_proj (q | k | v rows) and gate_up_proj (gate | up rows).
_PHI3 = Architecture(
    layers="model.layers",
    groups=(("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)),
    mappings=(
        AWQMapping("input_layernorm", ("self_attn.qkv_proj",), "self_attn"),
        AWQMapping("self_attn.qkv_proj", ("self_attn.o_proj",), "self_attn.o_proj", part=(2, 3)),
        AWQMapping("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
        AWQMapping("mlp.gate_up_proj", ("mlp.down_proj",), "mlp.down_proj", part=(1, 2)),
    ),
    no_clip=("self_attn.qkv_proj",),
)

# GPT-2: Conv1D layers, fused c_attn (q | k | v columns); GELU between c_fc and c_proj,
# so the MLP's second linear has no smoothing partner.
_GPT2 = Architecture(
    layers="transformer.h",
    groups=(("attn.c_attn",), ("attn.c_proj",), ("mlp.c_fc",), ("mlp.c_proj",)),
    mappings=(
        AWQMapping("ln_1", ("attn.c_attn",), "attn"),
        AWQMapping("attn.c_attn", ("attn.c_proj",), "attn.c_proj", part=(2, 3)),
        AWQMapping("ln_2", ("mlp.c_fc",), "mlp"),
    ),
    no_clip=("attn.c_attn",),
    conv1d=True,
)

# OPT: ReLU between fc1 and fc2 is positively homogeneous (relu(y/s) = relu(y)/s for s > 0),
# so fc1 -> fc2 smoothing is exact, as in AutoAWQ's OPT table.
_OPT = Architecture(
    layers="model.decoder.layers",
    groups=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.out_proj",),
        ("fc1",),
        ("fc2",),
    ),
    mappings=(
        AWQMapping("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
        AWQMapping("self_attn.v_proj", ("self_attn.out_proj",), "self_attn.out_proj"),
        AWQMapping("final_layer_norm", ("fc1",), "fc1"),
        AWQMapping("fc1", ("fc2",), "fc2"),
    ),
    no_clip=("self_attn.q_proj", "self_attn.k_proj"),
)

ARCHITECTURES: dict[str, Architecture] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "gemma2": _GEMMA,
    "gemma3_text": _GEMMA,
    "phi3": _PHI3,
    "gpt2": _GPT2,
    "opt": _OPT,
}


def architecture_for(model_type: str) -> Architecture:
    """The table entry for `model_type`; BadInput naming what to add when it is missing."""
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        raise BadInput(
            f"model_type {model_type!r} is not in the quantization table; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}. To add it, give it an entry in "
            "ARCHITECTURES in calib/architectures.py (decoder-layer path, true-sequential "
            "linear groups, AWQ smooth -> balance mappings)"
        )
    return arch


def check_model(model: Any, arch: Architecture) -> None:
    """Refuse configurations the table's entry does not describe."""
    config = model.config
    if config.model_type == "opt" and not getattr(config, "do_layer_norm_before", True):
        raise BadInput("OPT with do_layer_norm_before=False (opt-350m) is not supported: its norms follow the linears")
    if config.model_type == "opt" and getattr(config, "activation_function", "relu") != "relu":
        raise BadInput("OPT with a non-ReLU activation is not supported: fc1 -> fc2 smoothing needs ReLU")


def get_submodule(root: Any, path: str) -> Any:
    """`root.get_submodule(path)` with a BadInput naming the missing path."""
    try:
        return root.get_submodule(path)
    except AttributeError:
        raise BadInput(
            f"module {path!r} not found in {type(root).__name__}; the entry for this model type "
            "in calib/architectures.py does not match the model"
        ) from None
