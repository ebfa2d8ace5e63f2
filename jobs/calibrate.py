"""The calibrate job: measure every decoder linear's statistics on the fp model and save
them for `quantize --stats` (`calibrate(CalibrateOptions) -> CalibrateReport`)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer_tool.calib.recipe import DEFAULTS, STATS_NOTE
from infer_tool.common.progress import Progress


@dataclass
class CalibrateOptions:
    model: str
    out: str
    calib: str = DEFAULTS.calib
    num_samples: int = DEFAULTS.num_samples
    seq_len: int = DEFAULTS.seq_len
    seed: int = DEFAULTS.seed
    device: str | None = None
    allow_pickle: bool = False
    trust_remote_code: bool = False


@dataclass
class CalibrateReport:
    out: str
    model: str
    model_path: str
    model_type: str
    calib: str
    num_samples: int
    seq_len: int
    seed: int
    tokens: int
    measured_on: str
    linears: int
    note: str
    seconds: float
    memory: dict[str, float]
    world_size: int = 1  # processes the calibration ran on (accelerate launch / torchrun)
    samples_per_process: list[int] | None = None  # calibration sequences each process ran, in rank order

    def meta(self) -> dict[str, Any]:
        """What is saved beside the statistics (stats_index.json's `meta`)."""
        keys = ("model", "model_path", "model_type", "calib", "num_samples", "seq_len", "seed", "tokens", "measured_on")
        return {k: getattr(self, k) for k in keys}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check(opts: CalibrateOptions, overwrite: bool) -> None:
    """Every option checked before any model is loaded."""
    from infer_tool.calib.corpora import check_corpus
    from infer_tool.calib.models import classify_model_spec
    from infer_tool.calib.stats import check_stats_out
    from infer_tool.common.device import check_device

    check_device(opts.device or "auto")
    check_corpus(opts.calib, "--calib")
    kind, path = classify_model_spec(opts.model, opts.allow_pickle)
    check_stats_out(opts.out, overwrite=overwrite, protected=(path,) if kind == "dir" else ())


def calibrate(opts: CalibrateOptions, *, overwrite: bool = False, progress: Progress | None = None) -> CalibrateReport:
    check(opts, overwrite)
    from infer_tool.common.device import pick_device

    dev = pick_device(opts.device or "auto")
    import torch

    from infer_tool.calib.corpora import calibration_batch
    from infer_tool.calib.distributed import finish, stop_on_sigterm, world
    from infer_tool.calib.layers import peak_memory
    from infer_tool.calib.models import load_model
    from infer_tool.calib.pipeline import collect_stats, plan
    from infer_tool.calib.stats import save_stats

    t0 = time.perf_counter()
    loaded = load_model(
        opts.model, device="cpu", allow_pickle=opts.allow_pickle, trust_remote_code=opts.trust_remote_code
    )
    plan(loaded.model, None)
    ids = calibration_batch(loaded.tokenizer, opts.calib, opts.num_samples, opts.seq_len, opts.seed)
    rank, world_size = world()
    if world_size > 1:
        stop_on_sigterm()
    result = collect_stats(loaded.model, ids, device=dev, progress=progress)
    report = CalibrateReport(
        out=opts.out,
        model=opts.model,
        model_path=str(loaded.path),
        model_type=loaded.model.config.model_type,
        calib=opts.calib,
        num_samples=opts.num_samples,
        seq_len=opts.seq_len,
        seed=opts.seed,
        tokens=result.tokens,
        measured_on="fp model (no layer quantized)",
        linears=len(result.stats),
        note=STATS_NOTE,
        seconds=0.0,
        memory={},
        world_size=world_size,
        samples_per_process=result.samples_per_process,
    )
    if rank == 0:  # every process holds the same statistics
        save_stats(result.stats, Path(opts.out), meta=report.meta(), overwrite=overwrite)
    finish()
    report.seconds = time.perf_counter() - t0
    report.memory = peak_memory(torch.device(dev))
    return report
