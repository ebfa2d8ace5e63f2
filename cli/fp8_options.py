"""The FP8 options of `infer-tool quantize` (`--method fp8`), kept apart from the INT4
ones: the scheme they build, the checks made before any work, the KV-cache tensors to
store, and the one-line description of the scheme for the report table.

Flag -> scheme field: --fp8-granularity -> granularity, --fp8-activations -> activations,
--kv-cache -> kv_cache, --fp8-clip-search -> clip_search (defaults: packers/fp8.py).
"""

from __future__ import annotations

from typing import Any

from infer_tool.common.errors import BadInput

FP8_OPTIONS = {"fp8_granularity": "granularity", "fp8_activations": "activations", "kv_cache": "kv_cache", "fp8_clip_search": "clip_search"}
INT_OPTIONS = ("bits", "group_size", "symmetric", "act_order", "damp")
GRANULARITY_HELP = "FP8 weight scales: tensor, channel or block (128x128) [default: channel]."
ACTIVATIONS_HELP = "FP8 activations: dynamic (per token, no calibration) or static (calibrated per-tensor input_scale) [default: dynamic]."
KV_CACHE_HELP = "fp8: calibrate per-layer k_scale / v_scale (post-RoPE keys, values) for an FP8 KV cache [default: none]."
CLIP_HELP = "FP8: search weight clipping ratios minimising output error on calibration data."


def fp8_scheme(opts: Any) -> Any:
    """The Fp8Scheme of `--method fp8` options; INT4-only options are refused."""
    from infer_tool.packers.fp8 import make_fp8_scheme

    given = [n for n in INT_OPTIONS if getattr(opts, n, None) is not None]
    if given:
        flags = ", ".join("--" + n.replace("_", "-").replace("symmetric", "sym/--asym") for n in given)
        raise BadInput(f"{flags} do not apply to --method fp8 (e4m3 weights); use --fp8-granularity / --fp8-activations")
    if getattr(opts, "stats", None) is not None and getattr(opts, "kv_cache", None):
        raise BadInput("--kv-cache fp8 needs a calibration pass through the model; drop --stats")
    return make_fp8_scheme(**{field: getattr(opts, opt, None) for opt, field in FP8_OPTIONS.items()})


def check_no_fp8_options(opts: Any) -> None:
    """Refuse FP8 options with an INT4 method."""
    given = [n for n in FP8_OPTIONS if getattr(opts, n, None) not in (None, False)]
    if given:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        raise BadInput(f"{flags} apply to --method fp8 only (this run quantizes with --method {opts.method})")


def kv_tensors(result: Any, fmt_name: str) -> dict[str, Any] | None:
    """The k_scale / v_scale tensors to store, or None without an FP8 KV cache."""
    if not getattr(result, "kv_amax", None):
        return None
    from infer_tool.packers.fp8_formats import kv_scale_tensors

    return kv_scale_tensors(result.kv_amax, fmt_name)


def kv_scales(result: Any) -> dict[str, tuple[float, float]]:
    """{attention name: (k_scale, v_scale)} for evaluating the FP8 KV cache."""
    import torch

    from infer_tool.packers.fp8 import scale_from_amax

    def s(amax: float) -> float:
        return float(scale_from_amax(torch.tensor(amax)))

    return {n: (s(a.k_amax), s(a.v_amax)) for n, a in getattr(result, "kv_amax", {}).items()}


def describe(scheme: dict[str, Any]) -> str:
    """'fp8 e4m3 channel weights, dynamic activations, FP8 KV cache' for the report table."""
    text = f"fp8 e4m3 {scheme['granularity']} weights"
    if scheme["granularity"] == "block":
        text += f" {scheme['block_size'][0]}x{scheme['block_size'][1]}"
    text += f", {scheme['activations']} activations"
    if scheme.get("clip_search"):
        text += ", clip search"
    if scheme.get("kv_cache"):
        text += ", FP8 KV cache"
    return text


def eval_context(model: Any, result: Any, scheme: Any) -> Any:
    """Where `quantize --eval` measures ppl after quantizing: for FP8, the model as deployed
    (kernels' Fp8Linear W8A8, FP8 KV cache rounded with the calibrated scales); for INT4, the
    in-memory model (its weights are exactly the checkpoint's dequantized values)."""
    import contextlib

    if getattr(scheme, "method", None) != "fp8":
        return contextlib.nullcontext(model)
    from infer_tool.evals.fp8_runtime import fp8_runtime

    return fp8_runtime(model, result.quantized, kv_scales(result) or None)


EVALUATED_FP8 = (
    "the FP8 model as deployed: quantized linears run as the kernels' Fp8Linear (W8A8: e4m3 weights, "
    "activations rounded to e4m3 per token or with the static input_scale), KV cache rounded through "
    "e4m3 with the calibrated k_scale/v_scale when --kv-cache fp8"
)


def fp8_notes(result: Any, scheme: Any) -> list[str]:
    """Report notes for FP8 runs: block shapes runtimes refuse, KV scales transformers ignores."""
    if getattr(scheme, "method", None) != "fp8":
        return []
    from infer_tool.packers.fp8_formats import block_alignment_notes

    notes = []
    if scheme.granularity == "block":
        notes += block_alignment_notes({n: w.shape for n, w in result.quantized.items()}, scheme.block_size)
    if getattr(result, "kv_amax", None):
        notes.append(
            "k_scale/v_scale are read by vLLM (kv_cache_dtype fp8); transformers 5.x with compressed-tensors "
            "0.20 does not attach them (it looks for a past_key_value(s) argument) and reports them as unexpected keys"
        )
    return notes
