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
- `conv1d`: GPT-2's `Conv1D` stores its weight transposed, (K, N);
- `moe`: where a layer's MLP is a sparse mixture of experts (`MoE`): the block, its router,
  its experts and its shared expert. `groups` and `mappings` then describe the dense
  layers (DeepSeek's first layers, Qwen's `mlp_only_layers`); in an MoE layer the entries
  under the block are replaced by the experts' (`calib/moe.py`).

Module paths inside a decoder layer are relative to that layer. This module knows
nothing about solvers or file formats; adding an architecture means adding one entry
(and, when a configuration of it is not covered, a refusal in `check_model`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from infer_tool.common.errors import BadInput


@dataclass(frozen=True)
class AWQMapping:
    smooth: str
    balance: tuple[str, ...]
    inspect: str
    part: tuple[int, int] | None = None  # (i, n): i-th of n equal output slices of `smooth`


# The linears of one expert, as calibration names them (`calib/moe.py`).
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class MoE:
    """A sparse mixture-of-experts block, as transformers 5 implements it: a router
    (`block.gate`, never quantized) picks top-k experts per token; the experts are stored
    fused, `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I), and calibration replaces
    them by one gate/up/down linear per expert (`calib/moe.py`), named as in the original
    checkpoint: `{experts}.{j}.gate_proj`.

    shared: a dense MLP every token goes through (quantized like a dense MLP);
    shared_gate: its sigmoid gate Linear(H, 1) (Qwen2-MoE; never quantized);
    checkpoint_names: (module-name part, checkpoint-name part) substitutions, in order, from
        our module names to the original checkpoint's tensor names (Mixtral's
        `block_sparse_moe.experts.{j}.w1`); the inverse is applied reading them back.
    """

    block: str = "mlp"
    router: str = "mlp.gate"
    experts: str = "mlp.experts"
    shared: str | None = None
    shared_gate: str | None = None
    checkpoint_names: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Architecture:
    layers: str
    groups: tuple[tuple[str, ...], ...]
    mappings: tuple[AWQMapping, ...]
    norm_offset: float = 0.0
    no_clip: tuple[str, ...] = ()
    conv1d: bool = False
    moe: MoE | None = None

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for group in self.groups for name in group)

    def experts_in(self, layer: Any) -> int:
        """The number of routed experts of this decoder layer; 0 for a dense layer."""
        if self.moe is None:
            return 0
        try:
            experts = layer.get_submodule(self.moe.experts)
        except AttributeError:
            return 0
        fused = getattr(experts, "gate_up_proj", None)
        return int(fused.shape[0]) if fused is not None else len(experts)

    def for_layer(self, layer: Any) -> Architecture:
        """The entry as it applies to one decoder layer: in an MoE layer, without the groups
        and mappings that lie in the MoE block (the experts are handled by `calib/moe.py`)."""
        if not self.experts_in(layer):
            return self
        inside = f"{self.moe.block}."
        return replace(
            self,
            groups=tuple(g for g in self.groups if not g[0].startswith(inside)),
            mappings=tuple(m for m in self.mappings if not m.balance[0].startswith(inside)),
        )

    def moe_linears(self, layer: Any) -> tuple[str, ...]:
        """An MoE layer's quantizable linears: the shared expert's, then every expert's
        gate, up and down projections; () for a dense layer."""
        n = self.experts_in(layer)
        if not n:
            return ()
        shared = tuple(f"{self.moe.shared}.{p}" for p in EXPERT_PROJECTIONS) if self.moe.shared else ()
        return shared + tuple(f"{self.moe.experts}.{j}.{p}" for j in range(n) for p in EXPERT_PROJECTIONS)

    def layer_linears(self, layer: Any) -> tuple[str, ...]:
        """Every quantizable linear of one decoder layer, in processing order."""
        return self.for_layer(layer).linears + self.moe_linears(layer)

    def checkpoint_name(self, name: str) -> str:
        """A module or tensor name as the original checkpoint spells it."""
        for ours, theirs in self.moe.checkpoint_names if self.moe else ():
            name = f"{name}.".replace(f".{ours}.", f".{theirs}.")[:-1]
        return name

    def module_name(self, name: str) -> str:
        """The inverse of `checkpoint_name`."""
        for ours, theirs in reversed(self.moe.checkpoint_names if self.moe else ()):
            name = f"{name}.".replace(f".{theirs}.", f".{ours}.")[:-1]
        return name


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

# Mixtral: every layer is MoE; the original checkpoint names the block `block_sparse_moe`
# and the experts' projections w1 (gate), w3 (up), w2 (down), as vLLM's loader reads them.
_MIXTRAL = replace(
    _LLAMA,
    moe=MoE(
        checkpoint_names=(("mlp", "block_sparse_moe"), ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))
    ),
)

# Qwen2-MoE: a shared expert beside the routed ones, scaled by sigmoid(shared_expert_gate(x));
# layers in `mlp_only_layers` (or off `decoder_sparse_step`) are dense.
_QWEN2_MOE = replace(_LLAMA, moe=MoE(shared="mlp.shared_expert", shared_gate="mlp.shared_expert_gate"))
_QWEN3_MOE = replace(_LLAMA, moe=MoE())

# DeepSeek-V3: MLA attention (a low-rank query, q_a -> q_a_layernorm -> q_b, and a compressed
# KV latent, kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b), dense MLPs in the first
# `first_k_dense_replace` layers, then MoE with shared experts and a sigmoid router whose
# top-k choice adds a score-correction bias (a buffer of the router, left as it is).
_DEEPSEEK_V3 = Architecture(
    layers="model.layers",
    groups=(
        ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
        ("self_attn.q_b_proj",),
        ("self_attn.kv_b_proj",),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    ),
    mappings=(
        AWQMapping("input_layernorm", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"), "self_attn"),
        AWQMapping("self_attn.q_a_layernorm", ("self_attn.q_b_proj",), "self_attn.q_b_proj"),
        AWQMapping("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",), "self_attn.kv_b_proj"),
        AWQMapping("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        AWQMapping("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ),
    # q and k (nope and rope parts) come out of all four: their errors are amplified by q·kᵀ
    no_clip=("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj"),
    moe=MoE(shared="mlp.shared_experts"),
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
    "mixtral": _MIXTRAL,
    "qwen2_moe": _QWEN2_MOE,
    "qwen3_moe": _QWEN3_MOE,
    "deepseek_v3": _DEEPSEEK_V3,
}

# config attributes that give an MoE model away (its expert count)
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def architecture_for(model_type: str, config: Any = None) -> Architecture:
    """The table entry for `model_type`; BadInput naming what to add when it is missing
    (and, for a mixture-of-experts `config`, what an MoE entry needs)."""
    arch = ARCHITECTURES.get(model_type)
    experts = next((getattr(config, a) for a in _EXPERT_COUNTS if isinstance(getattr(config, a, None), int)), 0)
    if arch is None and experts > 0:
        moe_types = ", ".join(k for k, v in sorted(ARCHITECTURES.items()) if v.moe)
        raise BadInput(
            f"model_type {model_type!r} is a mixture of experts ({experts} experts) that is not in the "
            f"quantization table; MoE types supported: {moe_types}. To add it, give it an entry in "
            "ARCHITECTURES in calib/architectures.py: the decoder-layer path, the attention's "
            "true-sequential linear groups and AWQ mappings, and an MoE(block, router, experts, shared "
            "expert, checkpoint names) whose experts are transformers' fused gate_up_proj (E, 2I, H) / "
            "down_proj (E, H, I). Data-free schemes (rtn, FP8 dynamic, FP4 weights) need no entry: add --model-free"
        )
    if arch is None:
        raise BadInput(
            f"model_type {model_type!r} is not in the quantization table; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}. To add it, give it an entry in "
            "ARCHITECTURES in calib/architectures.py (decoder-layer path, true-sequential "
            "linear groups, AWQ smooth -> balance mappings). Data-free schemes (rtn, FP8 dynamic, FP4 weights) "
            "need no entry: add --model-free"
        )
    return arch


def check_model(model: Any, arch: Architecture) -> None:
    """Refuse configurations the table's entry does not describe."""
    config = model.config
    if config.model_type == "opt" and not getattr(config, "do_layer_norm_before", True):
        raise BadInput("OPT with do_layer_norm_before=False (opt-350m) is not supported: its norms follow the linears")
    if config.model_type == "opt" and getattr(config, "activation_function", "relu") != "relu":
        raise BadInput("OPT with a non-ReLU activation is not supported: fc1 -> fc2 smoothing needs ReLU")
    if config.model_type == "deepseek_v3" and getattr(config, "q_lora_rank", None) is None:
        raise BadInput("deepseek_v3 with q_lora_rank null (one q_proj, no q_a/q_b) is not in the table's entry")


def get_submodule(root: Any, path: str) -> Any:
    """`root.get_submodule(path)` with a BadInput naming the missing path."""
    try:
        return root.get_submodule(path)
    except AttributeError:
        raise BadInput(
            f"module {path!r} not found in {type(root).__name__}; the entry for this model type "
            "in calib/architectures.py does not match the model"
        ) from None
