"""Roofline times of the passes a speculative round is made of, on one GPU type at a
batch: the target's pass over batch x q new tokens (q = 1: a plain decode step; q = m + 1:
the verify pass of m drafts) and the draft's decode steps. Standard library only.

A pass over q tokens per sequence is `roofline.step_times`' verify pass of a speculation
with k = q - 1 drafts at draft cost 0 (its `pass_s` term): memory = weights + batch x KV
read, compute = batch x q x FLOPs per token, the larger of the two. One GPU, no tensor
or pipeline parallelism; every sequence of the batch drafts the same m (a homogeneous
batch).

Models come from their config.json (`served_model`): the weight dtype the roofline reads
is the checkpoint's own quantization (`quantization_config`: INT4 / INT8 / FP8) or bf16.
A `truncated:N` draft is the target's shape with its first N layers (`truncated`).

`batch_times` gathers what a projection needs at one concurrency; `describe` states
what it rests on.

What this module does not know: acceptance, or what a round's costs are used for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.sizing.config_view import ConfigView
from infer_tool.sizing.defaults import DEFAULT_MEM_UTIL, DEFAULT_RESERVE_BYTES
from infer_tool.sizing.hf_config import shape_from_config
from infer_tool.sizing.kv import kv_dtype, sequence_bytes
from infer_tool.sizing.params import estimate_params
from infer_tool.sizing.presets import GpuPreset
from infer_tool.sizing.roofline import Efficiency, Hardware, Speculation, Workload, step_times
from infer_tool.sizing.shape import ModelShape
from infer_tool.sizing.weights import weight_bytes

SERVING_DTYPE = "bf16"  # weights without a quantization_config, and the KV cache
BLOCK_SIZE = 16  # vLLM's paged-attention block, for the memory check


@dataclass(frozen=True)
class ServedModel:
    """A model as the projection serves it: its shape, weight dtype and group size."""

    shape: ModelShape
    weights: str = SERVING_DTYPE  # bf16 | fp8 | int8 | int4
    group_size: int = 128
    config: dict[str, Any] | None = None  # the config.json it was read from
    shares_weights: bool = False  # a truncated target: its weights are the target's

    @property
    def weight_bytes(self) -> int:
        assert self.shape.params is not None
        return weight_bytes(self.shape.params, self.weights, self.group_size).total


def weights_of(config: dict[str, Any]) -> tuple[str, int]:
    """(weight dtype, group size) of a checkpoint from its `quantization_config`:
    compressed-tensors int 4/8-bit, 8-bit float or 4-bit float (NVFP4 / MXFP4, W4A4 or A16)
    groups, GPTQ / AWQ `bits`, native FP8;
    bf16 without one. Group size -1: one group per output channel."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        return SERVING_DTYPE, 128
    method = str(qc.get("quant_method", ""))
    if method == "fp8":
        return "fp8", 128
    if method in ("gptq", "awq"):
        bits, group = qc.get("bits"), qc.get("group_size", 128)
    elif method == "compressed-tensors":
        groups = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
        w = groups[0] if groups else {}
        if w.get("type") == "float" and w.get("num_bits") == 8:
            return "fp8", 128
        if w.get("type") == "float" and w.get("num_bits") == 4:  # NVFP4 (E4M3 scales per 16) / MXFP4 (E8M0 per 32)
            fmt = "nvfp4" if w.get("group_size") == 16 else "mxfp4"
            groups = (qc.get("config_groups") or {}).values()
            inputs = [g.get("input_activations") for g in groups if isinstance(g, dict)]
            return (fmt if any(inputs) else f"{fmt}a16"), int(w.get("group_size") or 16)
        bits, group = w.get("num_bits"), w.get("group_size") or -1
    else:
        raise BadInput(
            f"quantization method {method!r} is not one the projection can size; accepted: "
            "compressed-tensors, gptq, awq, fp8"
        )
    if bits not in (4, 8) or not isinstance(group, int) or (group < 1 and group != -1):
        raise BadInput(
            f"{method} checkpoint with bits {bits!r}, group size {group!r}: the projection sizes "
            "4- and 8-bit integer weights only"
        )
    return ("int4" if bits == 4 else "int8"), group


def served_model(config: dict[str, Any], name: str, source: str = "") -> ServedModel:
    """The model a config.json describes, with its own weight dtype; BadInput when its
    parameters cannot be counted (the roofline needs them)."""
    shape = shape_from_config(config, name=name, source=source or name)
    if shape.params is None:
        raise BadInput(f"{name}: cannot count its parameters for the projection ({'; '.join(shape.notes)})")
    weights, group = weights_of(config)
    return ServedModel(shape, weights, group, config)


def truncated(target: ServedModel, n: int, name: str) -> ServedModel:
    """The target's first `n` layers with its embeddings, final norm and head."""
    assert target.config is not None
    layers = target.shape.layers[:n]
    params = estimate_params(ConfigView(target.config, target.shape.source or name), layers)
    shape = replace(target.shape, name=name, layers=layers, params=params)
    return replace(target, shape=shape, shares_weights=True)


@dataclass(frozen=True)
class Serving:
    """Where and how the passes run: one GPU of type `gpu`, the roofline's efficiencies,
    the KV-cache dtype, and each sequence's prompt and output lengths (the decode step is
    taken at the mean context, prompt + output / 2)."""

    gpu: GpuPreset
    eff: Efficiency
    prompt_len: int
    output_len: int
    kv: str = SERVING_DTYPE

    @property
    def hardware(self) -> Hardware:
        return Hardware.from_preset(self.gpu)

    @property
    def context(self) -> float:
        return self.prompt_len + self.output_len / 2


def pass_times(model: ServedModel, serving: Serving, batch: int, q: int) -> tuple[float, str]:
    """(seconds, 'memory' or 'compute') of one pass of `model` over `batch` sequences of
    `q` new tokens each; the bound is the larger roofline term of that pass."""
    spec = None if q == 1 else Speculation(alpha=0.0, k=q - 1, cost_ratio=0.0)
    t = step_times(
        model.shape,
        serving.hardware,
        Workload(serving.prompt_len, serving.output_len, batch, spec),
        weights=model.weights,
        kv=serving.kv,
        group_size=model.group_size,
        eff=serving.eff,
    )
    if q == 1:
        return t.decode_step_s, t.bound
    # compute grows with q (q x the step's FLOPs); the weights and KV are read once
    return t.terms["pass_s"], ("compute" if q * t.compute_s > t.memory_s else "memory")


def memory_needed(models: list[ServedModel], serving: Serving, batch: int) -> int:
    """Bytes of the models' weights (a truncated draft's are the target's) plus `batch`
    sequences' KV caches at the full context (prompt + output), each model caching its
    own layers."""
    kv = kv_dtype(serving.kv)
    context = serving.prompt_len + serving.output_len
    cache = sum(sequence_bytes(m.shape.layers, context, kv, tp=1, block=BLOCK_SIZE).alone for m in models)
    return sum(m.weight_bytes for m in models if not m.shares_weights) + batch * cache


@dataclass(frozen=True)
class BatchTimes:
    """Roofline seconds of the passes of a speculative round at one concurrency B, for a
    target and its drafts (what `projection` turns into round costs)."""

    concurrency: int
    step_s: float  # target pass over B x 1 tokens
    bound: str  # of that step
    pass_s: dict[int, float]  # m -> target pass over B x (m + 1) tokens, m = 0..max_m
    pass_bound: dict[int, str]
    draft_s: tuple[tuple[float, float], ...]  # per draft: passes over B x 1 and B x 2 tokens; (0, 0): free
    memory_bytes: tuple[int, ...]  # per draft: target + that draft, weights and KV caches
    usable_bytes: int  # GPU memory x DEFAULT_MEM_UTIL less DEFAULT_RESERVE_BYTES


def batch_times(
    serving: Serving, target: ServedModel, drafts: tuple[ServedModel | None, ...], concurrency: int, max_m: int
) -> BatchTimes:
    """The passes at `concurrency` sequences; a draft of None is free (prompt lookup)."""
    B = concurrency
    step, bound = pass_times(target, serving, B, 1)
    passes = {m: pass_times(target, serving, B, m + 1) for m in range(max_m + 1)}
    draft_s = tuple(
        (0.0, 0.0) if d is None else (pass_times(d, serving, B, 1)[0], pass_times(d, serving, B, 2)[0]) for d in drafts
    )
    memory = tuple(memory_needed([target] + ([d] if d is not None else []), serving, B) for d in drafts)
    usable = int(serving.gpu.memory_bytes * DEFAULT_MEM_UTIL - DEFAULT_RESERVE_BYTES)
    return BatchTimes(
        B,
        step,
        bound,
        {m: t for m, (t, _) in passes.items()},
        {m: b for m, (_, b) in passes.items()},
        draft_s,
        memory,
        usable,
    )


ASSUMPTIONS = (
    "one GPU per model pair (no tensor or pipeline parallelism), draft and target on it",
    "every sequence of the batch drafts the same number of tokens (a homogeneous batch)",
    "a model draft runs its k steps at the same batch; prompt lookup costs nothing on the GPU",
    "decode phase only (no prefill, no prefill interference), no per-step launch or scheduling overhead",
)


def _model_inputs(m: ServedModel) -> dict[str, Any]:
    s = m.shape
    assert s.params is not None
    return {
        "weights": m.weights,
        "group_size": m.group_size if m.weights == "int4" else None,
        "weight_bytes": m.weight_bytes,
        "shares_target_weights": m.shares_weights,
        "layers": s.num_layers,
        "hidden_size": s.hidden_size,
        "attention_heads": s.num_attention_heads,
        "kv_heads": s.layers[0].kv_heads if s.layers else 0,
        "params": s.params.total,
        "active_params": s.params.active,
        "source": s.source,
    }


def describe(
    serving: Serving,
    target: ServedModel,
    drafts: tuple[ServedModel | None, ...],
    names: list[str],
    concurrencies: tuple[int, ...],
) -> dict[str, Any]:
    """What a projection rests on, for its report: GPU figures, efficiencies, dtypes,
    model shapes, context, concurrencies and assumptions."""
    gpu = serving.gpu
    models = [{"name": target.shape.name, "role": "target", **_model_inputs(target)}]
    for name, d in zip(names, drafts):
        models.append({"name": name, "role": "draft", **({"free": True} if d is None else _model_inputs(d))})
    return {
        "gpu": gpu.key,
        "gpu_name": gpu.name,
        "hbm_bytes_per_s": gpu.hbm_bytes_per_s,
        "bf16_flops": gpu.bf16_flops,
        "fp8_flops": gpu.fp8_flops,
        "gpu_memory_bytes": gpu.memory_bytes,
        "gpu_source": gpu.spec_source,
        "efficiency": asdict(serving.eff),
        "kv_dtype": serving.kv,
        "prompt_len": serving.prompt_len,
        "output_len": serving.output_len,
        "mean_context": serving.context,
        "concurrencies": list(concurrencies),
        "models": models,
        "assumptions": list(ASSUMPTIONS),
    }
