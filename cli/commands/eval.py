"""`infer-tool eval ppl MODEL`: perplexity of a model or a quantized checkpoint; `infer-tool eval kld MODEL
--reference FP_MODEL`: its KL divergence from the reference, token by token."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from infer_tool.cli.options import AllowPickle, Device, Json, NoProgress, TrustRemoteCode
from infer_tool.cli.output import cli_command, emit_json, err, out, progress_bar, quiet_libraries
from infer_tool.jobs.eval_kld import KldOptions

eval_app = typer.Typer(help="Evaluate models.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(eval_app, name="eval")


@eval_app.command("ppl")
@cli_command
def ppl(
    model: Annotated[
        str,
        typer.Argument(
            help="Model directory, .gguf file, our quantized checkpoint, demo name (smollm2-135m) or hub name."
        ),
    ],
    data: Annotated[
        str,
        typer.Option(
            "--data",
            help="Corpus: sotu:eval, sotu:calib, sotu, a .txt, .jsonl, .json or .parquet file, or a HF dataset name.",
        ),
    ] = "sotu:eval",
    text_field: Annotated[str, typer.Option(help="Text field of .jsonl, .json, .parquet and HF corpora.")] = "text",
    seq_len: Annotated[int, typer.Option(help="Window length in tokens (capped by the model's context).")] = 2048,
    max_tokens: Annotated[int | None, typer.Option(help="Evaluate only the first N tokens of the corpus.")] = None,
    stride: Annotated[
        int | None, typer.Option(help="Sliding-window evaluation: start a window every STRIDE tokens.")
    ] = None,
    baseline: Annotated[str | None, typer.Option(help="A second model evaluated on the identical windows.")] = None,
    dtype: Annotated[str, typer.Option(help="Compute dtype: float32, bfloat16 or float16.")] = "float32",
    device: Device = "auto",
    kv_cache_dtype: Annotated[
        str,
        typer.Option(
            help=(
                "auto: keys/values in the compute dtype; fp8: through e4m3 with the checkpoint's k_scale/v_scale "
                "(as vLLM --kv-cache-dtype fp8)."
            )
        ),
    ] = "auto",
    activations: Annotated[
        str,
        typer.Option(
            help=(
                "auto: as the checkpoint is served (int8 for W8A8, e4m3 for FP8, unquantized for weight-only INT); "
                "int8: INT4 checkpoints too, per token, as vLLM's CPU build serves them on AMX CPUs (W4A8); "
                "none: every activation unquantized."
            )
        ),
    ] = "auto",
    int8_kernel: Annotated[
        str,
        typer.Option(
            help=(
                "Whose rounding int8 activations follow: auto (what vLLM runs here: cuda on a GPU; on a CPU the AMX "
                "kernel sgl where AMX is present and the shape allows, else onednn; sgl for W4A8), onednn, sgl or cuda."
            )
        ),
    ] = "auto",
    allow_pickle: AllowPickle = False,
    trust_remote_code: TrustRemoteCode = False,
    json_: Json = False,
    no_progress: NoProgress = False,
) -> None:
    """Perplexity of MODEL on a corpus (token-level; see the protocol in the output)."""
    from infer_tool.common.launch import rank0
    from infer_tool.jobs.eval_ppl import EvalOptions, check, evaluate

    opts = EvalOptions(
        model,
        data,
        text_field,
        seq_len,
        max_tokens,
        stride,
        baseline,
        dtype,
        device,
        kv_cache_dtype,
        allow_pickle,
        trust_remote_code,
        activations,
        int8_kernel,
    )
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
            r["model"],
            f"{r['ppl']:.4f}",
            f"{r['nll']:.5f}",
            str(r["tokens"]),
            f"{r['windows']} × {r['seq_len']}",
            f"{r['tokens_per_second']:.1f}",
            r["backend"],
            r.get("activations", ""),
        )
    out().print(table)
    if "baseline" in report:
        out().print(f"ratio {report['ppl_ratio']:.4f}   delta {report['ppl_delta']:+.4f}")
    for note in report["notes"]:
        err().print(f"note: {note}", highlight=False)
    err().print(f"corpus {report['corpus']}; {report['protocol']}", highlight=False)


@eval_app.command("kld")
@cli_command
def kld(
    model: Annotated[
        str, typer.Argument(help="The model compared (typically our quantized checkpoint): any MODEL eval ppl takes.")
    ],
    reference: Annotated[
        str,
        typer.Option(
            "--reference", help="The reference (typically the unquantized model): same tokenizer and vocabulary."
        ),
    ],
    data: Annotated[str, typer.Option("--data", help="Corpus, as eval ppl's --data.")] = KldOptions.data,
    text_field: Annotated[
        str, typer.Option(help="Text field of .jsonl, .json, .parquet and HF corpora.")
    ] = KldOptions.text_field,
    seq_len: Annotated[
        int, typer.Option(help="Window length in tokens (capped by the models' context).")
    ] = KldOptions.seq_len,
    max_tokens: Annotated[
        int | None, typer.Option(help="Evaluate only the first N tokens of the corpus.")
    ] = KldOptions.max_tokens,
    stride: Annotated[
        int | None, typer.Option(help="Sliding-window evaluation: start a window every STRIDE tokens.")
    ] = KldOptions.stride,
    dtype: Annotated[
        str, typer.Option(help="Compute dtype of both models: float32, bfloat16 or float16.")
    ] = KldOptions.dtype,
    device: Device = KldOptions.device,
    kv_cache_dtype: Annotated[
        str, typer.Option(help="MODEL's KV cache, as eval ppl's --kv-cache-dtype (the reference's stays auto).")
    ] = KldOptions.kv_cache_dtype,
    allow_pickle: AllowPickle = KldOptions.allow_pickle,
    trust_remote_code: TrustRemoteCode = KldOptions.trust_remote_code,
    json_: Json = False,
    no_progress: NoProgress = False,
) -> None:
    """KL(reference ‖ MODEL) per token over the full vocabulary, on the positions eval ppl scores: mean (95% interval),
    percentiles, max, same top token, and both perplexities."""
    from infer_tool.common.launch import rank0
    from infer_tool.jobs.eval_kld import check, evaluate

    opts = KldOptions(
        model,
        reference,
        data,
        text_field,
        seq_len,
        max_tokens,
        stride,
        dtype,
        device,
        kv_cache_dtype,
        allow_pickle,
        trust_remote_code,
    )
    check(opts)
    quiet_libraries()
    with progress_bar(rank0() and not no_progress) as bar:
        report = evaluate(opts, progress=bar)
    if not rank0():
        return
    if json_:
        emit_json(report)
        return
    _print_kld(report.to_dict())


def _print_kld(report: dict[str, Any]) -> None:
    from rich.table import Table

    def num(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    k, top = report["kld"], report["same_top_token"]
    m = k["mean"]
    table = Table(title=f"KL divergence from {report['reference']} (nats per token)", title_justify="left")
    for col in ("model", "mean KLD", "95% interval", "median", "p90", "p99", "p99.9", "max", "same top token"):
        table.add_column(col, justify="left" if col == "model" else "right")
    interval = "-" if m["ci95_low"] is None else f"{m['ci95_low']:.5f} .. {m['ci95_high']:.5f}"
    table.add_row(
        report["model"],
        f"{m['mean']:.5f}",
        interval,
        f"{k['median']:.5f}",
        f"{k['p90']:.5f}",
        f"{k['p99']:.4f}",
        f"{k['p99_9']:.4f}",
        f"{k['max']:.4f}",
        f"{100 * top['mean']:.2f}%",
    )
    out().print(table)
    ppl = Table(title="perplexity on the same tokens", title_justify="left")
    for col in ("model", "ppl", "mean NLL", "backend"):
        ppl.add_column(col, justify="left" if col in ("model", "backend") else "right")
    ppl.add_row(report["model"], f"{report['ppl']:.4f}", f"{report['nll']:.5f}", report["backend"])
    ppl.add_row(
        report["reference"],
        f"{report['reference_ppl']:.4f}",
        f"{report['reference_nll']:.5f}",
        report["reference_backend"],
    )
    out().print(ppl)
    out().print(
        f"{report['tokens']} tokens in {report['windows']} × {report['seq_len']} windows, "
        f"{report['tokens_per_second']:.1f} tokens/s; standard error of the mean KLD "
        f"{num(m['se_tokens'], '.2g')} (tokens as independent), {num(m['se_windows'], '.2g')} (windows)"
    )
    for note in report["notes"]:
        err().print(f"note: {note}", highlight=False)
    err().print(f"corpus {report['corpus']}; {report['protocol']}", highlight=False)
