"""`infer-tool eval ppl MODEL`: perplexity of a model or a quantized checkpoint."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from infer_tool.cli.options import AllowPickle, Device, Json, NoProgress, TrustRemoteCode
from infer_tool.cli.output import cli_command, emit_json, err, out, progress_bar, quiet_libraries

eval_app = typer.Typer(help="Evaluate models.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(eval_app, name="eval")


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
    device: Device = "auto",
    kv_cache_dtype: Annotated[str, typer.Option(help="auto: keys/values in the compute dtype; fp8: through e4m3 with the checkpoint's k_scale/v_scale (as vLLM --kv-cache-dtype fp8).")] = "auto",
    activations: Annotated[str, typer.Option(help="auto: as the checkpoint is served (int8 for W8A8, e4m3 for FP8, unquantized for weight-only INT); int8: INT4 checkpoints too, per token, as vLLM's CPU build serves them on AMX CPUs (W4A8); none: every activation unquantized.")] = "auto",
    int8_kernel: Annotated[str, typer.Option(help="Whose rounding int8 activations follow: auto (what vLLM runs here: cuda on a GPU; on a CPU the AMX kernel sgl where AMX is present and the shape allows, else onednn; sgl for W4A8), onednn, sgl or cuda.")] = "auto",
    allow_pickle: AllowPickle = False,
    trust_remote_code: TrustRemoteCode = False,
    json_: Json = False,
    no_progress: NoProgress = False,
) -> None:
    """Perplexity of MODEL on a corpus (token-level; see the protocol in the output)."""
    from infer_tool.common.launch import rank0
    from infer_tool.jobs.eval_ppl import EvalOptions, check, evaluate

    opts = EvalOptions(model, data, text_field, seq_len, max_tokens, stride, baseline, dtype, device, kv_cache_dtype,
                       allow_pickle, trust_remote_code, activations, int8_kernel)
    check(opts)
    quiet_libraries()
    with progress_bar(rank0() and not no_progress) as bar:
        report = evaluate(opts, progress=bar)
    if not rank0():
        return
    if json_:
        emit_json(report)
        return
    _print_table(report)


def _print_table(report: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="perplexity", title_justify="left")
    for col in ("model", "ppl", "mean NLL", "tokens", "windows × seq_len", "tokens/s", "backend", "activations"):
        table.add_column(col, justify="left" if col in ("model", "backend", "activations") else "right")
    rows = [report] + ([report["baseline"]] if "baseline" in report else [])
    for r in rows:
        table.add_row(
            r["model"], f"{r['ppl']:.4f}", f"{r['nll']:.5f}", str(r["tokens"]),
            f"{r['windows']} × {r['seq_len']}", f"{r['tokens_per_second']:.1f}", r["backend"], r.get("activations", ""),
        )
    out().print(table)
    if "baseline" in report:
        out().print(f"ratio {report['ppl_ratio']:.4f}   delta {report['ppl_delta']:+.4f}")
    for note in report["notes"]:
        err().print(f"note: {note}", highlight=False)
    err().print(f"corpus {report['corpus']}; {report['protocol']}", highlight=False)
