"""Quality, time, memory and size of `infer-tool quantize` on the demo model (issues 4, 5).

Every row is two processes: `infer-tool quantize ... --json` (its report gives the
quantize time, calibration + solve, and the process's peak RSS), then
`infer-tool eval ppl CHECKPOINT --json` on the same windows as the fp32 row (run once).
So every row's ppl is measured from the checkpoint on disk, by the same evaluator.

    python benchmarks/quantize.py                                  # all rows, the issues' protocol
    python benchmarks/quantize.py --only "AWQ sym" "FP8 channel" --json rows.jsonl
    python benchmarks/quantize.py --llmcompressor /path/to/venv/bin/python --only "GPTQ sym" "llmc GPTQ sym"

Protocol defaults: group size 64, 128 x 512 calibration tokens of sotu:calib (seed 0),
the first 40,960 tokens of sotu:eval in 2048-token windows.

`--llmcompressor PYTHON` adds llm-compressor rows on the same model, the same
calibration token ids and the same scheme: `benchmarks/llmcompressor_oneshot.py` runs
under that interpreter (llm-compressor pins other transformers / compressed-tensors
versions than ours, so it lives in its own venv: `pip install torch==2.13.0
llmcompressor==0.14.0.1`); its checkpoint is evaluated by our `eval ppl` as ours are.
GPTQ rows of both sides use static act-order (llm-compressor's default). A second table
puts each row beside llm-compressor's of the same name, or of the longest name it extends
("GPTQ asym gptaq" beside "llmc GPTQ asym"): ppl increase, KL divergence and quantize
seconds as ratios, ours over theirs. The `gptaq` rows run `--gptaq 0.25` (GPTQ toward the fp
model's output):

    python benchmarks/quantize.py --llmcompressor PYTHON --no-plain \
        --only "GPTQ asym gptaq" "GPTQ sym gptaq" "llmc GPTQ asym" "llmc GPTQ sym"

`--autoround PYTHON` adds the PyPI auto-round's rows (`benchmarks/autoround_pypi.py` under
that interpreter: auto-round 0.16.x in its own venv) on the same calibration token ids, the
same iterations, batch and scheme as our AutoRound rows of the same name; `--iters N`
replaces the iteration count of every AutoRound row on both sides (a reduced run on a CPU).

Every row also gets the KL divergence from the source model (`infer-tool eval kld CHECKPOINT
--reference MODEL` on the same windows as its ppl: mean nats per token and "same top token");
`--no-kld` leaves it out. A row whose activations are quantized is scored once more with them
unquantized (what their rounding costs); `--no-plain` leaves that out.

Checks: GPTQ and AWQ each beat RTN of the same symmetry (exit 1 otherwise).

`--repeat N` runs every row's quantize process N times, in rounds over the selected rows (so
ours and llm-compressor's alternate, and a drift in the machine's speed reaches both); the
times in both tables are then the medians, with their range, and the script says whether
every run of a row wrote the same checkpoint bytes. ppl and KL divergence are the first run's:

    python benchmarks/quantize.py --llmcompressor PYTHON --no-kld --repeat 3 \
        --only "NVFP4A16 GPTQ" "llmc NVFP4A16 GPTQ"

MXFP8 rows (issue 59): MXFP8A16 and MXFP8 with RTN and GPTQ beside llm-compressor's presets of the same names
(`llmc MXFP8A16`, `llmc MXFP8A16 GPTQ`, ...). W4AFP8 has no row: its groups of 128 divide none of the demo's
linears but down_proj (K = 576 elsewhere), in our tool and in llm-compressor alike.

FP4 rows (issue 28): NVFP4A16, NVFP4 (W4A4), MXFP4A16 and MXFP4 with RTN, GPTQ, AWQ and AWQ+GPTQ
(`--fp4 ... --fp4-activations ...`, the groups the format fixes), two with the MSE observer,
and llm-compressor's presets of the same names (`llmc NVFP4A16`: its QuantizationModifier;
`llmc NVFP4A16 GPTQ` / `AWQ` and likewise for NVFP4, MXFP4A16 and MXFP4: its GPTQModifier /
AWQModifier on that preset); `... RTN data-free` rows pass `--no-layer-error` (NVFP4A16, MXFP4A16, MXFP4):

    python benchmarks/quantize.py --llmcompressor PYTHON --only "NVFP4A16 RTN" "llmc NVFP4A16" ...

INT8 rows (issue 29): W8A8 (`--scheme W8A8`: int8 channel weights, int8 per-token dynamic
activations) with RTN, GPTQ and SmoothQuant + GPTQ at several alphas, and W8A16; each W8A8
checkpoint is scored by `eval ppl` with its activations quantized as vLLM's kernel on this
machine does (the report's "activations" column says which). "W4A8" rows score INT4
checkpoints with `eval ppl --activations int8` (as vLLM's CPU build serves them on AMX
CPUs). `llmc W8A8 ...` rows run llm-compressor's SmoothQuantModifier + GPTQModifier W8A8
recipe on the same calibration token ids:

    python benchmarks/quantize.py --llmcompressor PYTHON --only "W8A8 GPTQ" "W8A8 SQ0.5 GPTQ" "llmc W8A8 SQ0.8 GPTQ"

`--vllm PYTHON` scores every row's checkpoint (and the source model) once more in vLLM's CPU
build (`tests/vllm_worker.py` under that interpreter, `make vllm-env`: bf16, prompt logprobs)
on the same windows, next to our `eval ppl --dtype bfloat16` with the activations vLLM quantizes
on this host (INT4 rows run W4A8 there only with AMX; `VLLM_CPU_INT4_W4A8` is set per row), and
prints how far apart the two engines are (issue 29's goal: within 1% on every row vLLM runs):

    python benchmarks/quantize.py --vllm .venv-vllm/bin/python --no-kld --no-plain --only "W8A8 RTN"

MoE rows (issue 14): `--model` an upcycled MoE (`benchmarks/upcycle_moe.py`); the table
then adds, per row, the routed-token spread over experts (min / median / max of every
expert's count, over all MoE layers), the experts fallen back to RTN, the expert linears
left unquantized (the source checkpoint's against the written one's) and the scales that
are NaN, Inf or zero in the written checkpoint (read from disk). `--dense FILE` (rows
saved with `--json` from a run on the dense demo) adds each method's ppl increase against
the dense model's, with the goal of at most 1.2x for GPTQ and AWQ:

    python benchmarks/quantize.py --only "GPTQ sym" "AWQ sym" --json dense.jsonl
    python benchmarks/quantize.py --model /tmp/smollm2-8x-mixtral --only "RTN sym" "GPTQ sym" "AWQ sym" \
        "FP8 channel" --dense dense.jsonl --json moe.jsonl [--llmcompressor PYTHON]

llm-compressor's MoE rows calibrate every expert on every token (its
`moe_calibrate_all_experts`), as ours do by default.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

INT4 = "int4"
INT8 = "int8"  # presets fix the weight groups: no --group-size
FP8 = "fp8"
FP4 = "fp4"
LLMC = "llmc"
AR = "auto-round"  # the PyPI package, under --autoround PYTHON
SMOOTHQUANT_SWEEP = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


# label -> (kind, quantize flags, eval flags)
def fp4_flags(preset: str, method: str) -> list[str]:
    """Our quantize flags for llm-compressor's FP4 preset name (NVFP4A16, NVFP4, MXFP4A16, MXFP4)."""
    activations = "none" if preset.endswith("A16") else "fp4"
    return ["--method", method, "--fp4", preset[:5].lower(), "--fp4-activations", activations]


ROWS: dict[str, tuple[str, list[str], list[str]]] = {
    "RTN sym": (INT4, ["--method", "rtn", "--sym"], []),
    "RTN asym": (INT4, ["--method", "rtn", "--asym"], []),
    "GPTQ sym": (INT4, ["--method", "gptq", "--sym", "--act-order"], []),
    "GPTQ asym": (INT4, ["--method", "gptq", "--asym", "--act-order"], []),
    "AWQ sym": (INT4, ["--method", "awq", "--sym"], []),
    "AWQ asym": (INT4, ["--method", "awq", "--asym"], []),
    "AWQ sym fast": (INT4, ["--method", "awq", "--sym", "--awq-search", "fast"], []),
    "AWQ asym fast": (INT4, ["--method", "awq", "--asym", "--awq-search", "fast"], []),
    "AWQ+GPTQ sym": (INT4, ["--method", "awq+gptq", "--sym"], []),
    "AWQ+GPTQ asym": (INT4, ["--method", "awq+gptq", "--asym"], []),
    **{  # group scales by llm-compressor's MSE observer grid
        f"{label} mse": (INT4, [*flags, "--observer", "mse"], [])
        for label, flags in (
            ("RTN sym", ["--method", "rtn", "--sym"]),
            ("GPTQ sym", ["--method", "gptq", "--sym", "--act-order"]),
            ("GPTQ asym", ["--method", "gptq", "--asym", "--act-order"]),
            ("AWQ+GPTQ sym", ["--method", "awq+gptq", "--sym"]),
            ("AWQ+GPTQ asym", ["--method", "awq+gptq", "--asym"]),
        )
    },
    **{  # GPTQ toward the fp model's output (GPTAQ's asymmetric calibration, its alpha 0.25)
        f"{label} {kind} gptaq{tag}": (INT4, [*flags, f"--{kind}", "--gptaq", "0.25", *more], [])
        for label, flags in (("GPTQ", ["--method", "gptq", "--act-order"]), ("AWQ+GPTQ", ["--method", "awq+gptq"]))
        for kind in ("sym", "asym")
        for tag, more in (("", []), (" mse", ["--observer", "mse"]))
    },
    # the +-7 grid, as these rows ran before full range became autoround's symmetric default ("... full" below)
    "AutoRound sym": (
        INT4,
        ["--method", "autoround", "--sym", "--no-full-range", "--iters", "200", "--batch", "8"],
        [],
    ),
    "AutoRound asym": (INT4, ["--method", "autoround", "--asym", "--iters", "200", "--batch", "8"], []),
    "AutoRound sym 50": (
        INT4,
        ["--method", "autoround", "--sym", "--no-full-range", "--iters", "50", "--batch", "8"],
        [],
    ),
    "AutoRound asym 50": (INT4, ["--method", "autoround", "--asym", "--iters", "50", "--batch", "8"], []),
    **{  # the signed full-range grid for symmetric groups (llama.cpp's Q4_0, auto-round's default)
        f"{label} full": (INT4, [*flags, "--full-range"], [])
        for label, flags in (
            ("RTN sym", ["--method", "rtn", "--sym"]),
            ("GPTQ sym", ["--method", "gptq", "--sym", "--act-order"]),
            ("GPTQ sym gptaq", ["--method", "gptq", "--sym", "--act-order", "--gptaq", "0.25"]),
            ("AWQ sym", ["--method", "awq", "--sym"]),
            ("AWQ+GPTQ sym", ["--method", "awq+gptq", "--sym"]),
            ("AutoRound sym 50", ["--method", "autoround", "--sym", "--iters", "50", "--batch", "8"]),
            ("AutoRound sym", ["--method", "autoround", "--sym", "--iters", "200", "--batch", "8"]),
        )
    },
    # tuned in bfloat16: auto-round's own default on a CPU with bfloat16 (its `amp`; "auto-round ... amp")
    "AutoRound sym 50 full bf16": (
        INT4,
        ["--method", "autoround", "--sym", "--full-range", "--iters", "50", "--batch", "8", "--tune-dtype", "bfloat16"],
        [],
    ),
    "AutoRound asym 50 bf16": (
        INT4,
        ["--method", "autoround", "--asym", "--iters", "50", "--batch", "8", "--tune-dtype", "bfloat16"],
        [],
    ),
    "FP8 tensor": (FP8, ["--fp8-granularity", "tensor"], []),
    "FP8 channel": (FP8, ["--fp8-granularity", "channel"], []),
    "FP8 block": (FP8, ["--fp8-granularity", "block"], []),
    "FP8 tensor static": (FP8, ["--fp8-granularity", "tensor", "--fp8-activations", "static"], []),
    "FP8 channel static": (FP8, ["--fp8-granularity", "channel", "--fp8-activations", "static"], []),
    "FP8 channel + KV": (FP8, ["--fp8-granularity", "channel", "--kv-cache", "fp8"], ["--kv-cache-dtype", "fp8"]),
    "FP8 tensor static + KV (native)": (
        FP8,
        ["--fp8-granularity", "tensor", "--fp8-activations", "static", "--kv-cache", "fp8", "--format", "fp8"],
        ["--kv-cache-dtype", "fp8"],
    ),
    **{
        f"{preset} {method.upper()}": (FP4, fp4_flags(preset, method), [])
        for preset in ("NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4")
        for method in ("rtn", "gptq", "awq", "awq+gptq")
    },
    **{  # AutoRound on the FP4 grid at the CPU-friendly iteration count
        f"{preset} AutoRound 50": (FP4, [*fp4_flags(preset, "autoround"), "--iters", "50", "--batch", "8"], [])
        for preset in ("NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4")
    },
    # data-free: no calibration text read, no layer errors (llm-compressor's DataFreePipeline does neither)
    **{
        f"{preset} RTN data-free": (FP4, [*fp4_flags(preset, "rtn"), "--no-layer-error"], [])
        for preset in ("NVFP4A16", "MXFP4A16", "MXFP4")  # MXFP4's activation scales are dynamic
    },
    "NVFP4A16 RTN mse": (FP4, ["--method", "rtn", "--fp4", "nvfp4", "--observer", "mse"], []),
    "NVFP4A16 GPTQ mse": (FP4, ["--method", "gptq", "--fp4", "nvfp4", "--observer", "mse"], []),
    # MXFP8 (issue 59): the format fixes its groups (32) as FP4 does
    **{
        f"{preset} {method.upper()}": (FP4, ["--scheme", preset, "--method", method], [])
        for preset in ("MXFP8A16", "MXFP8")
        for method in ("rtn", "gptq")
    },
    "MXFP8A16 RTN data-free": (FP4, ["--scheme", "MXFP8A16", "--method", "rtn", "--no-layer-error"], []),
    "MXFP8A16 AutoRound 50": (
        FP4,
        ["--scheme", "MXFP8A16", "--method", "autoround", "--iters", "50", "--batch", "8"],
        [],
    ),
    "W8A8 RTN": (INT8, ["--scheme", "W8A8", "--method", "rtn"], []),
    "W8A8 GPTQ": (INT8, ["--scheme", "W8A8"], []),
    **{f"W8A8 SQ{a} GPTQ": (INT8, ["--scheme", "W8A8", "--smoothquant", str(a)], []) for a in SMOOTHQUANT_SWEEP},
    "W8A8 static RTN": (INT8, ["--scheme", "W8A8", "--method", "rtn", "--int8-activations", "static"], []),
    "W8A8 static GPTQ": (INT8, ["--scheme", "W8A8", "--int8-activations", "static"], []),
    # the preset's group 128 (compressed-tensors' W8A16) does not divide the demo's K = 576: --group-size overrides it
    "W8A16 GPTQ": (INT8, ["--scheme", "W8A16", "--method", "gptq", "--group-size", "64"], []),
    "W4A8 GPTQ sym": (INT4, ["--method", "gptq", "--sym", "--act-order"], ["--activations", "int8"]),
    "W4A8 AWQ sym": (INT4, ["--method", "awq", "--sym"], ["--activations", "int8"]),
    "W4A8 AWQ asym": (INT4, ["--method", "awq", "--asym"], ["--activations", "int8"]),
    "llmc GPTQ sym": (LLMC, ["--method", "gptq"], []),
    "llmc GPTQ asym": (LLMC, ["--method", "gptq", "--asym"], []),
    "llmc AWQ sym": (LLMC, ["--method", "awq"], []),
    "llmc AWQ asym": (LLMC, ["--method", "awq", "--asym"], []),
    "auto-round sym": (AR, ["--iters", "200", "--batch", "8"], []),
    "auto-round asym": (AR, ["--asym", "--iters", "200", "--batch", "8"], []),
    "auto-round sym 50": (AR, ["--iters", "50", "--batch", "8"], []),
    "auto-round asym 50": (AR, ["--asym", "--iters", "50", "--batch", "8"], []),
    "auto-round sym 50 amp": (AR, ["--iters", "50", "--batch", "8", "--amp"], []),
    "auto-round asym 50 amp": (AR, ["--asym", "--iters", "50", "--batch", "8", "--amp"], []),
    **{
        f"llmc {preset}": (LLMC, ["--scheme", preset, "--method", "rtn"], [])
        for preset in ("NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4")
    },
    **{
        f"llmc {preset} {method.upper()}": (LLMC, ["--scheme", preset, "--method", method], [])
        for preset in ("NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4")
        for method in ("gptq", "awq")
    },
    **{
        f"llmc {preset}{suffix}": (LLMC, ["--scheme", preset, "--method", method], [])
        for preset in ("MXFP8A16", "MXFP8")
        for method, suffix in (("rtn", ""), ("gptq", " GPTQ"))
    },
    "llmc W8A8 GPTQ": (LLMC, ["--method", "w8a8"], []),
    "llmc W8A8 SQ0.5 GPTQ": (LLMC, ["--method", "w8a8", "--smoothquant", "0.5"], []),
    "llmc W8A8 SQ0.8 GPTQ": (LLMC, ["--method", "w8a8", "--smoothquant", "0.8"], []),
}
EXTERNAL = (LLMC, AR)  # rows run by another package's interpreter on saved calibration ids


def with_iters(flags: list[str], iters: int | None) -> list[str]:
    """`flags` with the value after --iters replaced by `iters` (when given)."""
    if iters is None or "--iters" not in flags:
        return flags
    i = flags.index("--iters")
    return [*flags[: i + 1], str(iters), *flags[i + 2 :]]


def cli() -> str:
    return str(Path(sys.executable).parent / "infer-tool")


def run_json(cmd: list[str], label: str) -> tuple[dict, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    external = label.startswith(("llmc", "auto-round"))
    return json.loads(proc.stdout.strip().splitlines()[-1] if external else proc.stdout), wall


def eval_ppl(ckpt: str, args: argparse.Namespace, extra: list[str]) -> dict:
    cmd = [
        cli(),
        "eval",
        "ppl",
        ckpt,
        "--data",
        args.eval,
        "--max-tokens",
        str(args.eval_tokens),
        "--seq-len",
        str(args.eval_seq_len),
        "--json",
        "--no-progress",
        *extra,
    ]
    return run_json(cmd, f"eval {ckpt}")[0]


def eval_kld(ckpt: str, args: argparse.Namespace) -> dict:
    """`eval kld CHECKPOINT --reference MODEL` on eval_ppl's windows."""
    cmd = [
        cli(),
        "eval",
        "kld",
        ckpt,
        "--reference",
        args.model,
        "--data",
        args.eval,
        "--max-tokens",
        str(args.eval_tokens),
        "--seq-len",
        str(args.eval_seq_len),
        "--json",
        "--no-progress",
    ]
    return run_json(cmd, f"eval kld {ckpt}")[0]


def eval_windows(args: argparse.Namespace) -> list[list[int]]:
    """eval_ppl's windows as token id lists: the first --eval-tokens of --eval, tokenized as
    `eval ppl` does by --model's tokenizer, in --eval-seq-len-token windows."""
    from transformers import AutoTokenizer

    from infer_tool.calib.corpora import load_text, tokenize
    from infer_tool.evals.ppl import make_windows

    tokenizer = AutoTokenizer.from_pretrained(source_dir(args.model))
    ids = tokenize(load_text(args.eval), tokenizer, args.eval_tokens).tolist()
    return [ids[w.begin : w.end] for w in make_windows(len(ids), args.eval_seq_len)]


def source_dir(model: str) -> str:
    """The local directory of --model (the demo's GGUF converted once, as `quantize` does)."""
    from infer_tool.calib.models import resolve_model_dir

    return str(resolve_model_dir(model)[0])


def vllm_ppl(name: str, ckpt: str, args: argparse.Namespace, windows: list[list[int]], w4a8: bool) -> dict:
    """vLLM's record of one checkpoint on `windows` (tests/vllm_worker.py under --vllm):
    ppl, or `error` where vLLM refuses it; `host` is the worker's CPU record."""
    import os

    worker = Path(__file__).resolve().parents[1] / "tests" / "vllm_worker.py"
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        spec, results, log = Path(tmp) / "jobs.json", Path(tmp) / "results.jsonl", Path(tmp) / "worker.log"
        spec.write_text(json.dumps({"windows": windows, "jobs": [{"name": name, "path": ckpt}]}))
        env = {**os.environ, "VLLM_CPU_INT4_W4A8": "1" if w4a8 else "0"}
        with open(log, "w") as f:
            try:
                subprocess.run(
                    [args.vllm, str(worker), str(spec), str(results)],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    env=env,
                    timeout=args.vllm_timeout,
                )
            except subprocess.TimeoutExpired:
                return {"error": f"vLLM ran past --vllm-timeout {args.vllm_timeout} s"}
        lines = [json.loads(x) for x in results.read_text().splitlines()] if results.exists() else []
        tail = " ".join(log.read_text().split()[-40:])
    host = next((x for x in lines if x.get("host")), {})
    rec = next((x for x in lines if x.get("name") == name and "seconds" in x), None)
    if rec is None:
        return {"error": f"the vLLM worker wrote no result; its log ends: {tail}", "host": host}
    return {**rec, "host": host}


def vllm_columns(name: str, ckpt: str, args: argparse.Namespace, windows: list[list[int]], eval_flags: list[str]):
    """vLLM's ppl of a checkpoint and ours in bf16 with the activations vLLM quantizes on this
    host: W4A8 (`--activations int8` rows) only where the host has AMX."""
    w4a8 = "--activations" in eval_flags and eval_flags[eval_flags.index("--activations") + 1] == "int8"
    rec = vllm_ppl(name, ckpt, args, windows, w4a8)
    amx = bool(rec.get("host", {}).get("amx"))
    flags = eval_flags if amx or not w4a8 else []  # without AMX vLLM serves INT4 as W4A16
    ours = eval_ppl(ckpt, args, [*flags, "--dtype", "bfloat16"])
    out = {"ours_bf16_ppl": ours["ppl"], "ours_bf16_activations": ours.get("activations", "")}
    if "ppl" in rec:
        out.update(vllm_ppl=rec["ppl"], vllm_rel=rec["ppl"] / ours["ppl"] - 1, vllm_score_s=rec.get("score_s"))
        out["vllm_w4a8"] = any(rec.get("w4a8") or [])
        out["vllm_int8_paths"] = sorted(set(rec.get("int8_paths") or []))
    else:
        out["vllm_error"] = rec.get("error", "")
    return out


def vllm_table(rows: list[dict]) -> None:
    """vLLM's ppl against ours (bf16, the activations vLLM quantizes) per row."""
    rows = [r for r in rows if "ours_bf16_ppl" in r]
    if not rows:
        return
    print()
    print("| config | ours, bf16 | activations (ours) | vLLM | vLLM vs ours | vLLM's int8 path / W4A8 |")
    print("|---|---:|---|---:|---:|---|")
    for r in rows:
        if "vllm_ppl" in r:
            path = ", ".join(r["vllm_int8_paths"]) + (" W4A8" if r["vllm_w4a8"] else "")
            vllm = f"{r['vllm_ppl']:.4f} | {r['vllm_rel'] * 100:+.2f}% | {path}"
        else:
            vllm = f"refused | | {r['vllm_error'][:120]}"
        print(f"| {r['config']} | {r['ours_bf16_ppl']:.4f} | {r['ours_bf16_activations']} | {vllm} |")


def dir_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.glob("*.safetensors")) / 2**20


def checkpoint_digest(path: Path) -> str:
    """sha256 over a checkpoint's safetensors files (name and bytes, in name order)."""
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def repeat_rows(rows: list[dict], args: argparse.Namespace, workdir: Path, ids_file: Path, model_dir: str) -> None:
    """Runs 2..--repeat of every row's quantize process, in rounds over the rows (ours and
    llm-compressor's interleaved, so a drift in the machine's speed reaches both); each row's
    `quantize_s` / `process_s` become the medians of its runs, and `same_bytes` says whether
    every run wrote the first run's checkpoint bytes."""
    for k in range(2, args.repeat + 1):
        for row in rows:
            first = out_dir(row["config"], workdir)
            out = first.with_name(f"{first.name}-run{k}")
            q = run_quantize(row["config"], args, out, ids_file, model_dir)
            row["quantize_s_runs"].append(q["quantize_s"])
            row["process_s_runs"].append(q["process_s"])
            row["same_bytes"] = row.get("same_bytes", True) and checkpoint_digest(out) == row["checkpoint_sha256"]
            shutil.rmtree(out)
            progress = {"config": row["config"], "run": k, **{n: v for n, v in q.items() if n != "report"}}
            print(json.dumps(progress), file=sys.stderr, flush=True)
    for row in rows:
        row["quantize_s"] = statistics.median(row["quantize_s_runs"])
        row["process_s"] = statistics.median(row["process_s_runs"])


def seconds_cell(r: dict) -> str:
    """Quantize seconds: one run's, or the median of several with their range."""
    runs = r.get("quantize_s_runs") or [r["quantize_s"]]
    if len(runs) == 1:
        return f"{r['quantize_s']:.0f}"
    return f"{r['quantize_s']:.0f} ({min(runs):.0f}-{max(runs):.0f})"


def out_dir(label: str, workdir: Path) -> Path:
    return workdir / label.replace(" ", "-").replace("+", "").replace("(", "").replace(")", "").lower()


def run_quantize(label: str, args: argparse.Namespace, out: Path, ids_file: Path, model_dir: str) -> dict:
    """One quantize process of row `label` writing `out`: its report (`report`), the process
    wall time, the quantize seconds, peak RSS and mean layer error (ours only)."""
    kind, flags, _ = ROWS[label]
    flags = with_iters(flags, args.iters)
    if kind == AR:
        cmd = [
            args.autoround,
            str(Path(__file__).with_name("autoround_pypi.py")),
            "--model-dir",
            model_dir,
            "--ids",
            str(ids_file),
            "--group-size",
            str(args.group_size),
            "--out",
            str(out),
            *flags,
        ]
        r, wall = run_json(cmd, label)
        quantize_s, rss, err = r["quantize_s"], r["peak_rss_mib"], None
    elif kind == LLMC:
        routers = ["--ignore", *ROUTER_PATTERNS] if expert_linears(Path(model_dir)) else []
        cmd = [
            args.llmcompressor,
            str(Path(__file__).with_name("llmcompressor_oneshot.py")),
            "--model-dir",
            model_dir,
            "--ids",
            str(ids_file),
            "--group-size",
            str(args.group_size),
            "--out",
            str(out),
            *flags,
            *routers,
        ]
        r, wall = run_json(cmd, label)
        quantize_s, rss, err = r["oneshot_s"], r["peak_rss_mib"], None
    else:
        common = [
            "--calib",
            args.calib,
            "--num-samples",
            str(args.num_samples),
            "--seq-len",
            str(args.seq_len),
            "--seed",
            str(args.seed),
            "--out",
            str(out),
            "--json",
            "--no-progress",
        ]
        # FP4 and INT8 fix their groups
        method = {FP8: ["--method", "fp8"], FP4: [], INT8: []}.get(kind, ["--group-size", str(args.group_size)])
        r, wall = run_json([cli(), "quantize", args.model, *method, *flags, *common], label)
        quantize_s, rss, err = r["seconds"]["quantize"], r["memory"]["peak_rss_mib"], r["layer_error_mean"]
    return {"report": r, "process_s": wall, "quantize_s": quantize_s, "peak_rss_mib": rss, "layer_error_mean": err}


def quantize_row(label: str, args: argparse.Namespace, workdir: Path, ids_file: Path, model_dir: str) -> dict:
    _, _, eval_flags = ROWS[label]
    out = out_dir(label, workdir)
    q = run_quantize(label, args, out, ids_file, model_dir)
    r = q["report"]
    ev = eval_ppl(str(out), args, eval_flags)
    row = {
        "config": label,
        "ppl": ev["ppl"],
        "tokens": ev["tokens"],
        "quantize_s": q["quantize_s"],
        "process_s": q["process_s"],
        "peak_rss_mib": q["peak_rss_mib"],
        "checkpoint_mib": dir_mib(out),
        "layer_error_mean": q["layer_error_mean"],
        "num_samples": args.num_samples,
        "activations": ev.get("activations", ""),
        "quantize_s_runs": [q["quantize_s"]],
        "process_s_runs": [q["process_s"]],
        "checkpoint_sha256": checkpoint_digest(out),
    }
    if args.plain and ev.get("activations", "unquantized") != "unquantized":  # what the activations' rounding costs
        row["ppl_activations_unquantized"] = eval_ppl(str(out), args, ["--activations", "none"])["ppl"]
    if args.kld:
        k = eval_kld(str(out), args)
        mean = k["kld"]["mean"]
        row.update(
            kld=mean["mean"],
            kld_interval=[mean["ci95_low"], mean["ci95_high"]],
            kld_p99=k["kld"]["p99"],
            same_top_token=k["same_top_token"]["mean"],
        )
    if args.vllm:
        row.update(vllm_columns(label, str(out), args, args.windows, eval_flags))
    if expert_linears(Path(model_dir or args.model)):
        row.update(moe_columns(r.get("moe"), Path(model_dir or args.model), out))
    return row


EXPERT = re.compile(r"\.experts\.\d+\.[^.]+$")  # a per-expert linear's module name
# llm-compressor's MoE examples leave the routers unquantized (ours never quantize them)
ROUTER_PATTERNS = ["re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$", "re:.*shared_expert_gate$"]


def expert_linears(model_dir: Path) -> set[str]:
    """The per-expert linears of a checkpoint, as transformers' module names from its
    safetensors keys: Mixtral's files say `block_sparse_moe.experts.{j}.w1`, a checkpoint
    written from the linearized modules (llm-compressor's) `mlp.experts.{j}.gate_proj`."""
    from safetensors import safe_open

    from infer_tool.calib.architectures import architecture_for
    from infer_tool.calib.models import read_config

    try:
        arch = architecture_for(read_config(model_dir).get("model_type", ""))
    except Exception:  # not a model type of the table: names as they are
        arch = None
    names = set()
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                name = k.rsplit(".", 1)[0]
                name = arch.module_name(name) if arch else name
                if EXPERT.search(name):
                    names.add(name)
    return names


def bad_scales(ckpt: Path) -> int:
    """Scale values (any *scale* tensor) that are NaN, Inf or zero in a written checkpoint."""
    import torch
    from safetensors import safe_open

    bad = 0
    for f in ckpt.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if "scale" in k.rsplit(".", 1)[-1]:
                    t = st.get_tensor(k).float()
                    bad += int((~torch.isfinite(t) | (t == 0)).sum())
    return bad


def moe_columns(moe: dict | None, source: Path, ckpt: Path) -> dict:
    """Token spread, experts fallen back, expert linears unquantized, bad scales on disk."""
    out = {
        "expert_linears": len(expert_linears(source)),
        "experts_unquantized": len(expert_linears(source) - expert_linears(ckpt)),
        "bad_scales": bad_scales(ckpt),
    }
    if moe:  # our report (llm-compressor's has no counts)
        counts = sorted(c for t in moe["tokens"] for c in t["counts"])
        out.update(
            tokens_min=counts[0],
            tokens_median=counts[len(counts) // 2],
            tokens_max=counts[-1],
            experts_fallen_back=len(moe["fallback_experts"]),
            moe_calibration=moe["calibration"],
        )
    return out


def moe_table(rows: list[dict], dense_file: str | None) -> None:
    """The MoE columns, and each row's ppl increase against the dense run's same row."""
    dense = {}
    if dense_file:
        lines = [json.loads(x) for x in Path(dense_file).read_text().splitlines() if x.strip()]
        dense = {r["config"]: r for r in lines if "ratio" in r}
    print()
    print(
        "| config | increase | dense increase | / dense | tokens per expert min / median / max | fallen back "
        "| expert linears unquantized | bad scales | wall s (process) |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        inc = r["ratio"] - 1
        d = dense.get(r["config"])
        d_inc = f"{(d['ratio'] - 1) * 100:+.1f}%" if d else ""
        rel = f"{inc / (d['ratio'] - 1):.2f}x" if d and d["ratio"] > 1 else ""
        spread = (
            f"{r['tokens_min']} / {r['tokens_median']} / {r['tokens_max']}" if "tokens_min" in r else "(not reported)"
        )
        print(
            f"| {r['config']} | {inc * 100:+.1f}% | {d_inc} | {rel} | {spread} | {r.get('experts_fallen_back', '')} | "
            f"{r['experts_unquantized']} of {r['expert_linears']} | {r['bad_scales']} | {r['process_s']:.0f} |"
        )


def llmc_table(rows: list[dict]) -> None:
    """Each row of ours beside llm-compressor's of the same name ("X" and "llmc X"), or of the
    longest name it extends ("X mse", "X gptaq" beside "llmc X"): the issues' goals are
    ratios to it (ppl increase, KL divergence, quantize seconds)."""
    by = {r["config"]: r for r in rows}
    pairs = []
    for c in by:
        names = [n for n in by if n.startswith("llmc ") and (c == n[5:] or c.startswith(n[5:] + " "))]
        if names and not c.startswith("llmc "):
            pairs.append((by[c], by[max(names, key=len)]))
    if not pairs:
        return
    print()
    print("| rows, ours / llmc | ppl increase, ours / llmc | KLD mean, ours / llmc | quantize s, ours / llmc |")
    print("|---|---:|---:|---:|")
    for ours, theirs in pairs:
        ppl = f"{(ours['ratio'] - 1) / (theirs['ratio'] - 1):.3f}" if theirs["ratio"] > 1 else ""
        kld = f"{ours['kld'] / theirs['kld']:.3f}" if "kld" in ours and "kld" in theirs and theirs["kld"] > 0 else ""
        secs = f"{ours['quantize_s'] / theirs['quantize_s']:.2f}"
        print(f"| {ours['config']} / {theirs['config']} | {ppl} | {kld} | {secs} |")


def int8_table(rows: list[dict]) -> None:
    """W8A8 against llm-compressor's SmoothQuant + GPTQ recipe: ppl increase and quantize
    time ratios (goals: increase <= 0.9x theirs, time <= 0.5x theirs)."""
    by = {r["config"]: r for r in rows}
    theirs = [c for c in ("llmc W8A8 SQ0.8 GPTQ", "llmc W8A8 SQ0.5 GPTQ", "llmc W8A8 GPTQ") if c in by]
    ours = [c for c in by if c.startswith("W8A8 ")]
    if not theirs or not ours:
        return
    print()
    print(
        "| ours | llm-compressor | increase, ours | increase, theirs | / theirs (goal <= 0.9) "
        "| time / theirs (goal <= 0.5) |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for o in ours:
        for t in theirs:
            inc_o, inc_t = by[o]["ratio"] - 1, by[t]["ratio"] - 1
            rel = f"{inc_o / inc_t:.2f}" if inc_t > 0 else ""
            print(
                f"| {o} | {t} | {inc_o * 100:+.2f}% | {inc_t * 100:+.2f}% | {rel} | "
                f"{by[o]['quantize_s'] / by[t]['quantize_s']:.2f} |"
            )


def rtn_of(config: str, by: dict) -> str | None:
    """The RTN row a GPTQ / AWQ row must beat: the same name ending in RTN ("W8A8 static GPTQ"
    -> "W8A8 static RTN"), else the scheme's plain RTN row ("W8A8 SQ0.8 GPTQ" -> "W8A8 RTN")."""
    for rtn in (" ".join([*config.split()[:-1], "RTN"]), f"{config.split()[0]} RTN"):
        if rtn in by:
            return rtn
    return None


def calibration_ids(args: argparse.Namespace, path: Path) -> str:
    """Save the calibration token ids infer-tool uses (for llm-compressor); returns the model dir."""
    from safetensors.torch import save_file

    from infer_tool.calib.corpora import calibration_batch
    from infer_tool.calib.models import load_model

    loaded = load_model(args.model)
    ids = calibration_batch(loaded.tokenizer, args.calib, args.num_samples, args.seq_len, args.seed)
    save_file({"input_ids": ids.contiguous()}, str(path))
    return str(loaded.path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--calib", default="sotu:calib")
    p.add_argument("--num-samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval", default="sotu:eval")
    p.add_argument("--eval-tokens", type=int, default=40960)
    p.add_argument("--eval-seq-len", type=int, default=2048)
    p.add_argument("--only", nargs="*", help=f"rows to run: {', '.join(repr(r) for r in ROWS)}")
    p.add_argument(
        "--llmcompressor", metavar="PYTHON", help="an interpreter with llmcompressor installed (adds llmc rows)"
    )
    p.add_argument("--autoround", metavar="PYTHON", help="an interpreter with auto-round installed (adds its rows)")
    p.add_argument("--iters", type=int, help="iterations of every AutoRound row, ours and auto-round's")
    p.add_argument(
        "--kld",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="KL divergence of every row from --model (eval kld, the ppl windows)",
    )
    p.add_argument(
        "--plain",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also score each activation-quantized row with its activations unquantized",
    )
    p.add_argument("--vllm", metavar="PYTHON", help="vLLM's interpreter (.venv-vllm): score every row in vLLM too")
    p.add_argument("--vllm-timeout", type=float, default=3600, help="seconds one vLLM scoring may take")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every row's quantize N times (rounds over the rows); times are the medians",
    )
    p.add_argument("--json", help="append each row to this JSON-lines file as it finishes (with --repeat: at the end)")
    p.add_argument("--dense", metavar="JSONL", help="rows of a dense run (--json): compare each method's ppl increase")
    args = p.parse_args()

    if args.repeat < 1:
        p.error(f"--repeat {args.repeat}: expected 1 or more")
    unknown = [r for r in args.only or () if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    interpreters = {LLMC: args.llmcompressor, AR: args.autoround}
    labels = [
        r for r in ROWS if (r in args.only if args.only else ROWS[r][0] not in EXTERNAL or interpreters[ROWS[r][0]])
    ]
    if any(ROWS[r][0] == LLMC for r in labels) and not args.llmcompressor:
        p.error("llmc rows need --llmcompressor PYTHON")
    if any(ROWS[r][0] == AR for r in labels) and not args.autoround:
        p.error("auto-round rows need --autoround PYTHON")

    fp32 = eval_ppl(args.model, args, [])
    print(json.dumps({"config": "fp32", "ppl": fp32["ppl"], "tokens": fp32["tokens"]}), file=sys.stderr, flush=True)
    rows = []
    args.windows = eval_windows(args) if args.vllm else []
    source = {}
    if args.vllm:  # the source model in both engines: what they differ by before any quantization
        source = {"config": "source model", **vllm_columns("source", source_dir(args.model), args, args.windows, [])}
        print(json.dumps(source), file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-quantize-") as tmp:
        ids_file = Path(tmp) / "calib_ids.safetensors"
        model_dir = calibration_ids(args, ids_file) if any(ROWS[r][0] in EXTERNAL for r in labels) else ""
        for label in labels:
            row = quantize_row(label, args, Path(tmp), ids_file, model_dir)
            row["ratio"] = row["ppl"] / fp32["ppl"]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            if args.json and args.repeat == 1:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
        if args.repeat > 1:
            repeat_rows(rows, args, Path(tmp), ids_file, model_dir)
            if args.json:
                with open(args.json, "a") as f:
                    f.writelines(json.dumps(row) + "\n" for row in rows)

    print(
        f"{args.model}, group {args.group_size}, calibration {args.num_samples} x {args.seq_len} tokens "
        f"of {args.calib} "
        f"(seed {args.seed}), ppl on the first {fp32['tokens'] + fp32['windows']} tokens of {args.eval} "
        f"in {args.eval_seq_len}-token windows"
    )
    print(
        "| config | ppl | vs fp32 | KLD mean (95% interval) | KLD p99 | same top token | quantize s | peak RSS MiB "
        "| checkpoint MiB | mean layer err | activations | ppl, activations unquantized |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    print(f"| fp32 | {fp32['ppl']:.4f} | | | | | | | | | | |")
    for r in rows:
        err = "" if r["layer_error_mean"] is None else f"{r['layer_error_mean']:.4f}"
        low, high = r.get("kld_interval") or (None, None)
        interval = f" ({low:.4f}-{high:.4f})" if low is not None else ""
        kld = (
            f"{r['kld']:.4f}{interval} | {r['kld_p99']:.4f} | {r['same_top_token'] * 100:.1f}%"
            if "kld" in r
            else " | | "
        )
        plain = f"{r['ppl_activations_unquantized']:.4f}" if "ppl_activations_unquantized" in r else ""
        print(
            f"| {r['config']} | {r['ppl']:.4f} | {r['ratio']:.4f}x | {kld} | {seconds_cell(r)} | "
            f"{r['peak_rss_mib']:.0f} | {r['checkpoint_mib']:.1f} | {err} | {r.get('activations', '')} | {plain} |"
        )
    if args.repeat > 1:
        differ = [r["config"] for r in rows if not r.get("same_bytes", True)]
        print(
            f"quantize s: the median of {args.repeat} runs (min-max), in rounds over the rows; checkpoints "
            + (f"differ between runs: {', '.join(differ)}" if differ else "the same bytes in every run of every row")
        )
    llmc_table(rows)
    int8_table(rows)
    vllm_table([source, *rows] if source else rows)
    if any("expert_linears" in r for r in rows):
        moe_table(rows, args.dense)
    by = {r["config"]: r["ppl"] for r in rows}
    losers = [
        c
        for c in by
        if c.split()[0] in ("GPTQ", "AWQ") and f"RTN {c.split()[1]}" in by and by[c] >= by[f"RTN {c.split()[1]}"]
    ]
    losers += [
        c
        for c in by
        if c.split()[-1] in ("GPTQ", "AWQ")
        and c.split()[0] != "llmc"
        and (rtn := rtn_of(c, by)) is not None
        and by[c] >= by[rtn]
    ]
    if losers:
        print(f"FAIL: {', '.join(losers)} did not beat RTN of the same symmetry", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
