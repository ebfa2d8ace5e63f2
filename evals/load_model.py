"""Load any model `eval ppl` and `spec-profile` accept: a plain model (through
`calib.models`) or a quantized checkpoint written by this tool, rebuilt with the
kernels' quantized linear modules (fused Triton on CUDA, torch reference on CPU).

What this module does not know: how checkpoints are laid out on disk (packers' readers
know) or how the kernels compute (kernels/ knows).
"""

from __future__ import annotations

from typing import Any

from infer_tool.calib.models import (
    LoadedModel,
    load_from_dir,
    load_tokenizer,
    quantization_method,
    resolve_model_dir,
)
from infer_tool.common.errors import BadInput


def backend_of(model: Any) -> str:
    """Which matmul path the model's linear layers run: the kernels' backend name for
    quantized modules, else plain torch."""
    import torch

    device = next(model.parameters()).device if any(True for _ in model.parameters()) else torch.device("cpu")
    if any(hasattr(m, "activations_label") for m in model.modules()):  # a quantized evaluation module
        from infer_tool.kernels.quant_linear import backend_name

        return backend_name(device)
    return f"torch-{device.type} (unquantized)"


def activations_of(model: Any) -> str:
    """What the model's quantized linears do to their inputs, e.g. "int8 per token (onednn)",
    "int8 static input_scale (onednn)", "fp8 (e4m3)", "nvfp4 W4A4 (vLLM's emulation)" or
    "unquantized": each evaluation module's `activations_label()` (`kernels/quant_linear.py`)."""
    labels = {m.activations_label() for m in model.modules() if hasattr(m, "activations_label")}
    return "; ".join(sorted(label for label in labels if label)) or "unquantized"


def load_for_eval(
    spec: str,
    *,
    dtype: Any = None,
    device: str = "cpu",
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    kv_cache_dtype: str = "auto",
    activations: str = "auto",
    int8_kernel: str = "auto",
) -> LoadedModel:
    """A model ready for evaluation: plain, or one of our quantized checkpoints
    (`kv_cache_dtype`, `activations`, `int8_kernel`: see `load_quantized`)."""
    directory, notes = resolve_model_dir(spec, allow_pickle)
    method = quantization_method(directory)
    if method is None and kv_cache_dtype != "auto":
        raise BadInput(
            f"--kv-cache-dtype {kv_cache_dtype} needs a quantized checkpoint with KV-cache scales; "
            f"{spec} is not quantized"
        )
    if method is None and activations != "auto":
        raise BadInput(f"--activations {activations} applies to quantized checkpoints; {spec} is not quantized")
    if method is None:
        return load_from_dir(
            spec,
            directory,
            notes,
            dtype=dtype,
            device=device,
            allow_pickle=allow_pickle,
            trust_remote_code=trust_remote_code,
        )
    from infer_tool.evals.load_quantized import load_quantized

    model, more = load_quantized(
        directory,
        dtype=dtype,
        device=device,
        kv_cache_dtype=kv_cache_dtype,
        activations=activations,
        int8_kernel=int8_kernel,
    )
    notes += [f"quantized checkpoint ({method})", *more]
    tokenizer = load_tokenizer(directory, trust_remote_code)
    return LoadedModel(model=model, tokenizer=tokenizer, name=spec, path=directory, notes=notes)
