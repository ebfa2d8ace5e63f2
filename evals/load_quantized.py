"""Rebuild a quantized checkpoint written by this tool (compressed-tensors INT4, FP8 or FP4,
AWQ GEMM, GPTQ v1, native FP8) as a transformers model whose quantized linears are the
kernels' `Int4Linear` / `Fp8Linear` / `Fp4Linear`: packed weights stay packed, and the matmul
runs the fused Triton kernel on CUDA or the torch reference on CPU. FP4 W4A4 checkpoints
quantize each linear's input as vLLM's emulation does (`kernels/fp4_act.py`).

INT4 layers are repacked once, at load time, from the reader's canonical
`QuantizedWeight` into the kernels' layout (`Int4Linear.from_unpacked`); 8-bit ones (W8A8
`int-quantized`, W8A16 `pack-quantized`) become `Int8Linear`.

Activations (`activations`, `eval ppl --activations`): "auto" runs each checkpoint as it
is served (W8A8's int8 activations, FP8's e4m3 ones, W4A4 FP4's, none for weight-only
INT and FP4); "int8" also quantizes an INT4 checkpoint's activations per token as vLLM's CPU
build does on AMX CPUs (W4A8); "none" keeps every activation unquantized (W8A8, FP8 and W4A4
FP4 checkpoints as weights only). `int8_kernel` names whose rounding int8 activations follow ("auto": vLLM's choice
on this device and CPU, per linear; `kernels/int8_act.vllm_kernel`).
FP8 KV-cache scales (`k_scale`/`v_scale`) are for serving engines: evaluation here keeps
the KV cache in the compute dtype, and the returned notes say so.

Mixture-of-experts checkpoints store each expert under the original checkpoint's names
(`...experts.{j}.gate_proj`, Mixtral's `block_sparse_moe.experts.{j}.w1`): the model's
fused experts are split into one linear per expert (`calib.moe.unfuse_experts`, the
calibration's own layout) and each becomes a quantized linear, packed, on CPU and CUDA alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infer_tool.calib.architectures import ARCHITECTURES
from infer_tool.common.errors import BadInput


def _per_expert(model: Any, model_type: str) -> int:
    """Split an MoE model's fused experts into per-expert linears; the number of MoE layers."""
    from infer_tool.calib.moe import unfuse_experts

    arch = ARCHITECTURES.get(model_type)
    return unfuse_experts(model, arch) if arch is not None and arch.moe is not None else 0


def _set_module(model: Any, name: str, module: Any) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


KV_CACHE_DTYPES = ("auto", "fp8")


def load_quantized(
    directory: Path,
    dtype: Any = None,
    device: str = "cpu",
    kv_cache_dtype: str = "auto",
    activations: str = "auto",
    int8_kernel: str = "auto",
) -> tuple[Any, list[str]]:
    """(model in eval mode, notes) from one of our quantized checkpoint directories.

    `dtype` is the compute dtype of activations and unquantized layers (default: the
    checkpoint's own `torch_dtype`, else float32). `kv_cache_dtype` as vLLM's
    `--kv-cache-dtype`: "auto" keeps keys / values in the compute dtype, "fp8" rounds them
    through e4m3 with the checkpoint's k_scale / v_scale (an FP8 KV cache). `activations`,
    `int8_kernel`: see the module docstring."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from infer_tool.packers.checkpoint import format_of, read_checkpoint
    from infer_tool.packers.codecs.fp8_formats import read_kv_scales
    from infer_tool.packers.deploy import ACTIVATIONS, INT8_KERNELS, Deploy

    if activations not in ACTIVATIONS:
        raise BadInput(f"unknown --activations {activations!r}: expected one of {', '.join(ACTIVATIONS)}")
    if int8_kernel not in INT8_KERNELS:
        raise BadInput(f"unknown --int8-kernel {int8_kernel!r}: expected one of {', '.join(INT8_KERNELS)}")
    config, layers, rest = read_checkpoint(directory)
    codec = format_of(config["quantization_config"])
    deploy = Deploy(
        activations, int8_kernel, torch.device(device).type, codec.activations_quantized(config["quantization_config"])
    )
    if activations == "int8":
        bad = sorted({w.label for w in layers.values() if not w.takes_int8_activations(deploy)})
        if bad:
            raise BadInput(
                f"--activations int8 applies to INT4 checkpoints (W4A8, as vLLM's CPU build serves them on "
                f"AMX) and W8A8 ones; {directory} has {', '.join(bad)} weights"
            )
    kernels: set[str] = set()
    from dataclasses import replace

    from infer_tool.packers.codecs.mixed_precision import activations_by_linear

    # a mixed-precision checkpoint's groups differ in whether they quantize activations
    acts = activations_by_linear(config["quantization_config"], sorted(layers))
    hf_config = AutoConfig.from_pretrained(directory, local_files_only=True)
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config
    dtype = dtype or torch.float32
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    notes: list[str] = []
    moe_layers = _per_expert(model, hf_config.model_type)
    if moe_layers:
        arch = ARCHITECTURES[hf_config.model_type]
        layers = {arch.module_name(n): w for n, w in layers.items()}
        rest = {arch.module_name(n): t for n, t in rest.items()}
        notes.append(f"{moe_layers} MoE layers: every expert runs as its own quantized linears")
    for name, w in layers.items():
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            raise BadInput(
                f"{directory}: quantized layer {name!r} is not in the {hf_config.model_type} model"
            ) from None
        bias = rest.pop(f"{name}.bias", None)
        bias = bias.to(dtype) if bias is not None else None
        layer_deploy = replace(deploy, quantized_activations=acts.get(name, deploy.quantized_activations))
        module = w.to_linear(bias, dtype, layer_deploy, f"{directory}: layer {name}")
        if (module.in_features, module.out_features) != (linear.in_features, linear.out_features):
            raise BadInput(f"{directory}: layer {name} shape does not match the model config")
        _set_module(model, name, module)
        if module.int8_kernel is not None:
            kernels.add(module.int8_kernel)
    weight_types = {type(w) for w in layers.values()}
    if len(weight_types) == 1:
        notes.append(weight_types.pop().activations_note(layers, deploy, kernels, dtype))
    elif not weight_types:
        notes.append("activations unquantized")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise BadInput(f"unknown --kv-cache-dtype {kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    kv_scales = read_kv_scales(rest)
    for k in [k for k in rest if k.endswith((".k_scale", ".v_scale"))]:
        rest.pop(k)
    if kv_cache_dtype == "fp8" and not kv_scales:
        raise BadInput(f"--kv-cache-dtype fp8: {directory} has no k_scale / v_scale; quantize with --kv-cache fp8")
    if kv_cache_dtype == "fp8":
        notes.append("KV cache in FP8: keys / values rounded through e4m3 with the checkpoint's k_scale / v_scale")
    elif kv_scales:
        notes.append(
            "checkpoint carries FP8 KV-cache scales; evaluation keeps the KV cache unquantized "
            "(--kv-cache-dtype fp8 applies them)"
        )
    missing, unexpected = model.load_state_dict(rest, strict=False)
    if unexpected:
        raise BadInput(f"{directory}: tensors the model does not have: {', '.join(sorted(unexpected)[:5])}")
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    allowed = {"lm_head.weight"} if tied else set()
    missing = [m for m in missing if m not in allowed and m.rpartition(".")[0] not in layers]
    if missing:
        raise BadInput(f"{directory}: checkpoint lacks tensors: {', '.join(sorted(missing)[:5])}")
    if tied:
        model.tie_weights()
    if kv_cache_dtype == "fp8":
        from infer_tool.calib.kv_scales import add_fp8_kv_simulation

        add_fp8_kv_simulation(model, kv_scales)  # hooks live as long as the model
    model.to(device).eval()
    return model, notes
