"""`infer-tool spec-profile`: choose a draft model (and lookahead k) for speculative decoding.

Parses the options, runs `jobs.spec_profile.spec_profile` and prints its report
(`spec_profile_render`)."""

from __future__ import annotations

from typing import Annotated

import typer

from infer_tool.cli.options import AllowPickle, Device, HbmEfficiency, Json, Mfu, NoProgress, TrustRemoteCode
from infer_tool.cli.output import cli_command, emit_json, progress_bar, quiet_libraries
from infer_tool.jobs.spec_profile import SpecProfileOptions as Defaults
from infer_tool.sizing.defaults import DEFAULT_CONCURRENCY

HBM_HELP = HbmEfficiency.__metadata__[0].help
MFU_HELP = Mfu.__metadata__[0].help


def ascii_int(value: str | int) -> int:
    """typer parser of an integer option: ASCII digits only (click's int() takes "١٢")."""
    from infer_tool.spec.ascii_numbers import ascii_int as parse

    if isinstance(value, int):  # a default
        return value
    n = parse(value, signed=True)
    if n is None:
        raise typer.BadParameter(f"{value!r} is not a whole number in ASCII digits (e.g. 32)")
    return n


def ascii_float(value: str | float) -> float:
    """typer parser of a number option: ASCII digits, finite (float() takes "١٫٥", "nan", "1_0")."""
    from infer_tool.spec.ascii_numbers import ascii_float as parse

    if isinstance(value, float | int):  # a default
        return float(value)
    x = parse(value)
    if x is None:
        raise typer.BadParameter(f"{value!r} is not a finite number in ASCII digits (e.g. 0.7 or 1e-3)")
    return x


def register(app: typer.Typer) -> None:
    app.command("spec-profile")(spec_profile)


@cli_command
def spec_profile(
    target: Annotated[
        str, typer.Option("--target", help="Target model: directory, .gguf, demo name (smollm2-135m) or hub name.")
    ],
    draft: Annotated[
        list[str],
        typer.Option(
            "--draft",
            help=(
                "Draft (repeatable): a model or our quantized checkpoint, truncated:N, ngram, prompt-lookup[:N], "
                "suffix[:NAME=VALUE,...] (suffix decoding, needs arctic-inference; NAME: max_tree_depth, "
                "max_spec_factor, min_token_prob); with --engine vllm also a speculative_config JSON object "
                "(EAGLE-3, MTP...)."
            ),
        ),
    ],
    prompts: Annotated[
        str,
        typer.Option(
            "--prompts",
            help=(
                "sotu:eval (paragraphs), a .txt file (one prompt per line), .jsonl (one per record, optional "
                "'category' field), .json, .parquet or a HF dataset."
            ),
        ),
    ] = Defaults.prompts,
    text_field: Annotated[
        str,
        typer.Option(
            help=(
                "Text field of .jsonl, .json, .parquet and HF prompt files (a list of strings, e.g. Spec-Bench's "
                "turns, gives its first)."
            )
        ),
    ] = Defaults.text_field,
    num_prompts: Annotated[
        int, typer.Option(help="Prompts taken evenly spaced through the corpus.", parser=ascii_int)
    ] = Defaults.num_prompts,
    prompt_len: Annotated[
        int, typer.Option(help="Each prompt is cut to its first N tokens.", parser=ascii_int)
    ] = Defaults.prompt_len,
    max_new_tokens: Annotated[
        int, typer.Option(help="Tokens generated per prompt (the first by the prefill).", parser=ascii_int)
    ] = Defaults.max_new_tokens,
    k: Annotated[str, typer.Option("--k", help="Lookaheads: a range 1-8, a list 1,2,4 or one k.")] = Defaults.k,
    temperature: Annotated[
        float, typer.Option(help="Sampling temperature for target and drafts (0 = greedy).", parser=ascii_float)
    ] = Defaults.temperature,
    top_p: Annotated[
        float, typer.Option(help="Nucleus filtering applied to both target and draft.", parser=ascii_float)
    ] = Defaults.top_p,
    cost_ratio: Annotated[
        float | None,
        typer.Option(
            help=(
                "Draft cost per drafted token in target decode steps, replacing the measured draft cost "
                "(v(k) stays measured)."
            ),
            parser=ascii_float,
        ),
    ] = Defaults.cost_ratio,
    no_loop: Annotated[
        bool,
        typer.Option(
            "--no-loop", help="Screening: acceptance and costs only, no speculative loop; rank by prediction."
        ),
    ] = False,
    clock: Annotated[
        str,
        typer.Option(
            help=(
                "Timer: wall, cpu (this thread's CPU time, which other processes' load does not inflate; "
                "needs --threads 1 on a CPU) or auto (cpu when it can, else wall)."
            )
        ),
    ] = Defaults.clock,
    seed: Annotated[int, typer.Option(help="Seed for sampling and the bootstrap.", parser=ascii_int)] = Defaults.seed,
    dtype: Annotated[str, typer.Option(help="Compute dtype: float32, bfloat16 or float16.")] = Defaults.dtype,
    device: Device = Defaults.device,
    threads: Annotated[
        int | None,
        typer.Option(
            help=("CPU threads for torch (default: torch's choice); 1 gives steadier timings on a shared machine."),
            parser=ascii_int,
        ),
    ] = Defaults.threads,
    gpu: Annotated[
        str | None,
        typer.Option(
            help=(
                "Also project the speedups onto this GPU preset (kv-budget --list-gpus) with sizing's roofline: a "
                "projection, not a measurement."
            )
        ),
    ] = Defaults.gpu,
    concurrency: Annotated[
        list[str] | None,
        typer.Option(
            help=(
                "Concurrencies to project at with --gpu: 1,8,32 or 1..128 "
                f"(default {','.join(map(str, DEFAULT_CONCURRENCY))})."
            )
        ),
    ] = Defaults.concurrency,
    hbm_efficiency: Annotated[float | None, typer.Option(help=HBM_HELP, parser=ascii_float)] = Defaults.hbm_efficiency,
    mfu: Annotated[float | None, typer.Option(help=MFU_HELP, parser=ascii_float)] = Defaults.mfu,
    engine: Annotated[
        str,
        typer.Option(
            help=(
                "Who measures: ours (our transformers loop), vllm (vLLM itself, in its own process: per batch "
                "size, with the k-per-batch-size table) or both (and the cross-check)."
            )
        ),
    ] = Defaults.engine,
    batch_sizes: Annotated[
        str | None,
        typer.Option(
            help=(
                "Concurrent sequences to measure at, e.g. 1,4,16: vLLM's (--engine vllm/both, default 1,4,16); "
                "given with our loop, it also runs batched at each size (the table measured by our loop)."
            )
        ),
    ] = Defaults.batch_sizes,
    vllm_python: Annotated[
        str | None,
        typer.Option(
            help=(
                "Python of the vLLM environment (default: $INFER_TOOL_VLLM_PYTHON, else this Python if it "
                "imports vllm)."
            )
        ),
    ] = Defaults.vllm_python,
    repeats: Annotated[
        int,
        typer.Option(help="With --engine vllm: runs per (draft, k, batch size), for the interval.", parser=ascii_int),
    ] = Defaults.repeats,
    vllm_timeout: Annotated[
        float,
        typer.Option(help="Seconds each vLLM stage may take (a load; one batch size's runs).", parser=ascii_float),
    ] = Defaults.vllm_timeout,
    allow_pickle: AllowPickle = Defaults.allow_pickle,
    trust_remote_code: TrustRemoteCode = Defaults.trust_remote_code,
    json_: Json = False,
    no_progress: NoProgress = False,
) -> None:
    """Acceptance rate, round costs and predicted and measured speedups of each draft against the target; best k and a ranking."""  # noqa: E501
    from infer_tool.cli.commands import spec_profile_render as render
    from infer_tool.jobs.spec_profile import SpecProfileOptions, check
    from infer_tool.jobs.spec_profile import spec_profile as run

    opts = SpecProfileOptions(
        target=target,
        drafts=draft,
        prompts=prompts,
        text_field=text_field,
        num_prompts=num_prompts,
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens,
        k=k,
        temperature=temperature,
        top_p=top_p,
        cost_ratio=cost_ratio,
        loop=not no_loop,
        clock=clock,
        seed=seed,
        dtype=dtype,
        device=device,
        threads=threads,
        gpu=gpu,
        concurrency=concurrency,
        hbm_efficiency=hbm_efficiency,
        mfu=mfu,
        allow_pickle=allow_pickle,
        trust_remote_code=trust_remote_code,
        engine=engine,
        batch_sizes=batch_sizes,
        vllm_python=vllm_python,
        repeats=repeats,
        vllm_timeout=vllm_timeout,
    )
    checked = check(opts)  # before any progress bar or library noise
    quiet_libraries()
    with progress_bar(not no_progress) as bar:
        report = run(opts, checked, progress=bar)
    document = render.document(report)
    if json_:
        emit_json(document)
    else:
        render.human(document)
