"""Which tensors of a checkpoint `quantize --model-free` quantizes, read from their names,
shapes and dtypes alone (no model class), and which of them fuse in vLLM.

Quantized (targets): a floating `NAME.weight` of 2 dimensions (a linear's (N, K)), and a
floating 3-D tensor under `experts` (per-expert weights stacked (E, N, K), transformers'
fused `experts.gate_up_proj (E, 2I, H)` / `experts.down_proj (E, H, I)`, quantized expert by
expert along the last dimension). Kept as they are, by default (`DEFAULT_IGNORE`, regexes
searched in the module name, the tensor name less `.weight`): embeddings, the output head,
norms, MoE routers and their gates, multi-token-prediction (MTP / next-n) modules and
layers past `num_hidden_layers` (DeepSeek-V3 stores its MTP layer as layer 61 of 61),
vision / audio towers and projectors, convolutions. A user's `--ignore` (globs or
`re:REGEX`, as `quantize`'s) adds to them; `--no-default-ignore` drops them.

Fused groups (one NVFP4 global scale shared by their shards, as vLLM keeps one per fused
linear): q/k/v of one attention, gate/up (w1/w3) of one MLP or one expert, and DeepSeek's
q_a / kv_a projections. This module knows names only: no tensors, no files.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_IGNORE: tuple[str, ...] = (
    r"(^|\.)(embed_tokens|embeddings?|wte|wpe|word_embeddings|tok_embeddings|position_embeddings|embed_out)(\.|$)",
    r"(^|\.)(lm_head|output)$",
    r"norm",
    r"(^|\.)(gate|router|shared_expert_gate|gating)$",
    r"router",
    r"(^|\.)(mtp|nextn|next_n|mtp_block|mtp_layers?)(\.|$)|(^|\.)(eh_proj|enorm|hnorm)$",
    r"vision|visual|multi_modal|mm_projector|image|audio|speech",
    r"(^|\.)conv",
)
# shard suffix -> the family of a fused group (same module prefix, same expert)
FUSED = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
    "w1": "gate_up",
    "w3": "gate_up",
    "q_a_proj": "qkv_a",
    "kv_a_proj_with_mqa": "qkv_a",
}
_LAYER = re.compile(r"(^|\.)layers\.([0-9]+)\.", re.ASCII)


def module_of(name: str) -> str:
    """The module a tensor belongs to: `a.b.weight` -> `a.b`; a bare 3-D expert tensor
    (`mlp.experts.gate_up_proj`) is its own module."""
    return name.removesuffix(".weight")


@dataclass(frozen=True)
class Selection:
    """The default ignore patterns (regexes) in force, the user's (globs or `re:`), and the
    first layer index that is an MTP layer (None: none)."""

    defaults: tuple[str, ...]
    user: tuple[str, ...]
    mtp_from: int | None = None

    @classmethod
    def of(cls, config: Mapping[str, Any], ignore: Sequence[str], default_ignore: bool = True) -> Selection:
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        n_layers, n_mtp = text.get("num_hidden_layers"), text.get("num_nextn_predict_layers")
        mtp = n_layers if isinstance(n_layers, int) and isinstance(n_mtp, int) and n_mtp > 0 else None
        return cls(DEFAULT_IGNORE if default_ignore else (), tuple(ignore), mtp if default_ignore else None)

    def kept_by_default(self, module: str) -> bool:
        if any(re.search(p, module) for p in self.defaults):
            return True
        m = _LAYER.search(module)
        return self.mtp_from is not None and m is not None and int(m.group(2)) >= self.mtp_from

    def kept_by_user(self, module: str) -> bool:
        from infer_tool.calib.layers import matches

        return matches(module, self.user)

    def is_target(self, name: str, shape: Sequence[int], floating: bool) -> bool:
        """True when tensor `name` of `shape` is quantized."""
        if not floating:
            return False
        if len(shape) == 2 and name.endswith(".weight"):
            pass
        elif len(shape) == 3 and "experts" in name.split("."):
            pass
        else:
            return False
        module = module_of(name)
        return not (self.kept_by_default(module) or self.kept_by_user(module))

    def unmatched_user_patterns(self, modules: Sequence[str]) -> list[str]:
        from infer_tool.calib.layers import matches

        return [p for p in self.user if not any(matches(m, (p,)) for m in modules)]


def fused_group(module: str) -> tuple[str, str] | None:
    """(module prefix, family) of the fused group `module` belongs to, or None."""
    prefix, _, last = module.rpartition(".")
    family = FUSED.get(last)
    return (prefix, family) if family else None


def group_members(module: str, modules: Sequence[str]) -> list[str]:
    """The quantized modules sharing `module`'s fused group (itself included), sorted."""
    key = fused_group(module)
    if key is None:
        return [module]
    return sorted(m for m in modules if fused_group(m) == key)
