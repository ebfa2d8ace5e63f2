"""The quantize job as a library function: `quantize(QuantizeOptions) -> QuantizeReport`.

Steps: check every option (`check`, before any model is loaded), then the run
(`jobs/quantize_run.py`): load the model, round its weights to the checkpoint dtype, plan,
calibrate + quantize layer by layer (with --eval, the windows go through each layer before
and after; gate), write the checkpoint atomically with its report (`jobs/quantize_report.py`).
The CLI parses flags into `QuantizeOptions`, calls this and prints the report; nothing here
prints.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from infer_tool.calib.architectures import architecture_for
from infer_tool.calib.corpora import check_corpus
from infer_tool.calib.models import classify_model_spec, read_config
from infer_tool.calib.quantizers import quantizer_for
from infer_tool.calib.recipe import EVAL_ACTIVATIONS, QuantizeOptions, scheme_from_options
from infer_tool.common.device import check_device
from infer_tool.common.errors import BadInput
from infer_tool.common.progress import Progress, no_progress
from infer_tool.formats.registry import format_of_kind
from infer_tool.jobs.moe_report import moe_calibration
from infer_tool.jobs.preflight import check_processes, parse_limits
from infer_tool.jobs.quantize_report import QuantizeReport
from infer_tool.schemes.base import SCALE_DTYPES, Scheme

if TYPE_CHECKING:
    from infer_tool.packers.checkpoint import CheckpointFormat


def check(opts: QuantizeOptions, overwrite: bool) -> tuple[Scheme, CheckpointFormat]:
    """Every option checked before any model is loaded or text tokenized: (scheme, format)."""
    from infer_tool.calib.stats import saved_version  # these four import torch
    from infer_tool.common.sizes import parse_size
    from infer_tool.jobs.run_dir import check_progress
    from infer_tool.packers.checkpoint import check_checkpoint_out, get_format

    scheme = scheme_from_options(opts)
    fmt = get_format(opts.format, scheme.kind)
    fmt.check(scheme, {})
    if opts.out is None:
        raise BadInput("--out DIR is required when MODEL is given")
    if opts.dtype != "auto" and opts.dtype not in SCALE_DTYPES:
        raise BadInput(f"unknown --dtype {opts.dtype!r}: expected auto, {', '.join(SCALE_DTYPES)}")
    check_device(opts.device or "auto")
    check_patterns(opts.ignore)
    moe_calibration(opts)  # refuses a bad --moe-calibration / --moe-min-tokens
    if opts.eval_activations not in EVAL_ACTIVATIONS:
        raise BadInput(
            f"--eval-activations {opts.eval_activations!r} is not supported; use one of {', '.join(EVAL_ACTIVATIONS)}"
        )
    if opts.eval_activations == "int8":
        if opts.eval is None:
            raise BadInput("--eval-activations int8 needs --eval CORPUS")
        if "int8" not in format_of_kind(scheme.kind).runtime().eval_activation_modes(scheme):
            raise BadInput(
                f"--eval-activations int8 applies to INT4 schemes (served W4A8 by vLLM's CPU build on AMX) "
                f"and W8A8; {scheme.describe()} is neither"
            )
    if opts.max_ppl_increase is not None and opts.eval is None:
        raise BadInput("--max-ppl-increase needs --eval CORPUS (the ppl to compare)")
    if opts.max_kld is not None:
        if not opts.max_kld >= 0:
            raise BadInput(f"--max-kld {opts.max_kld} must be >= 0 (a mean KL divergence in nats per token, e.g. 0.05)")
        if opts.eval is None:
            raise BadInput("--max-kld needs --eval CORPUS (the KL divergence is measured on it)")
        if not opts.kld:
            raise BadInput("--max-kld needs the KL divergence: drop --no-kld")
    if opts.stats is not None:
        refusal = quantizer_for(scheme).stats_refusal(scheme)
        if refusal:
            raise BadInput(refusal)
        if not (Path(opts.stats) / "stats_index.json").is_file():
            raise BadInput(
                f"--stats {opts.stats!r} is not a statistics directory; make one with `infer-tool calibrate --out DIR`"
            )
        if quantizer_for(scheme).needs(scheme).activation_stats:
            from infer_tool.calib.stats import check_activation_ranges

            check_activation_ranges(Path(opts.stats), f"the static activation scales of {scheme.describe()}")
        if quantizer_for(scheme).needs(scheme).channel_max and (saved_version(Path(opts.stats)) or 0) < 2:
            raise BadInput(
                f"--stats {opts.stats!r} holds no per-channel activation maxima (saved by an infer-tool before "
                "statistics version 2), which --smoothquant needs; recalibrate with `infer-tool calibrate`"
            )
    elif opts.layer_error:
        check_corpus(opts.calib, "--calib")
    if not opts.layer_error and opts.stats is None and not quantizer_for(scheme).needs(scheme).data_free:
        raise BadInput(
            f"--no-layer-error skips calibration for data-free schemes only (rtn without --smoothquant or static "
            f"activations, fp8 dynamic, FP4 weights only): {scheme.describe()} reads calibration activations"
        )
    if opts.eval is not None:
        check_corpus(opts.eval, "--eval")
    kind, path = classify_model_spec(opts.model, opts.allow_pickle)
    check_checkpoint_out(opts.out, overwrite=overwrite, src_dir=path if kind == "dir" else None)
    parse_size(opts.max_shard_size, "--max-shard-size")
    parse_limits(opts.max_memory)
    check_progress(opts.out, opts.resume)
    check_processes(opts)
    if kind == "dir":  # the architecture table, before the weights are read
        config = read_config(path)
        model_type = config.get("model_type")
        if not isinstance(model_type, str):
            raise BadInput(f"{path / 'config.json'} has no model_type string (got {model_type!r})")
        architecture_for(model_type, SimpleNamespace(**config))
    return scheme, fmt


def quantize(
    opts: QuantizeOptions, *, overwrite: bool = False, recipe: str | None = None, progress: Progress | None = None
) -> QuantizeReport:
    """Open the model, check the memory estimate, calibrate + quantize layer by layer (with
    --eval, the evaluation windows go through each layer before and after), write the
    checkpoint from the finished layers; returns the report.

    The report's quality gates say whether `opts.max_ppl_increase` and `opts.max_kld` held;
    the caller decides what a failed gate means (the CLI exits 3). An interrupted run leaves its progress
    beside --out (`jobs/run_dir.py`); `opts.resume` continues it."""
    started = time.perf_counter()
    scheme, fmt = check(opts, overwrite)
    from infer_tool.jobs.quantize_run import open_job, run_job  # torch and transformers: once the options are fine

    return run_job(
        open_job(
            opts, scheme, fmt, started=started, overwrite=overwrite, recipe=recipe, progress=progress or no_progress
        )
    )


def check_patterns(patterns: tuple[str, ...]) -> None:
    """Refuse an `re:` pattern that is not a regular expression."""
    for p in patterns:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise BadInput(f"--ignore {p!r} is not a valid regular expression: {e}") from None
