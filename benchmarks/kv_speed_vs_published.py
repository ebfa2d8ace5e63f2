"""Predicted (sizing.roofline, default efficiencies) vs published decode throughput and
TTFT for the deployments in benchmarks/published_speed.json; prints the error of each.

    python benchmarks/kv_speed_vs_published.py
"""

from __future__ import annotations

import json
from pathlib import Path

from infer_tool.sizing.presets import gpu_preset
from infer_tool.sizing.resolve import resolve_model
from infer_tool.sizing.roofline import Hardware, Workload, step_times

DATA = Path(__file__).with_name("published_speed.json")


def predictions() -> list[dict]:
    """Each published row with `predicted_tok_s`, `published_tok_s` and `error`."""
    out = []
    for row in json.loads(DATA.read_text())["rows"]:
        shape = resolve_model(row["model"]).shape
        t = step_times(
            shape,
            Hardware.from_preset(gpu_preset(row["gpu"])),
            Workload(row["prompt"], row["output"], row["concurrency"]),
            weights=row["weights"],
            tp=row["tp"],
        )
        published = row.get("decode_tok_s") or row["concurrency"] * 1000 / row["itl_ms"]
        out.append(
            {
                **row,
                "predicted_tok_s": t.output_tokens_per_s,
                "published_tok_s": published,
                "error": t.output_tokens_per_s / published - 1,
                "predicted_ttft_ms": t.ttft_s * 1e3,
            }
        )
    return out


def main() -> None:
    print("| model | GPU | weights | tp | in/out | conc | published tok/s | predicted tok/s | error | source |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in predictions():
        print(
            f"| {r['model']} | {r['gpu']} | {r['weights']} | {r['tp']} | {r['prompt']}/{r['output']} | "
            f"{r['concurrency']} | {r['published_tok_s']:,.0f} | {r['predicted_tok_s']:,.0f} | {r['error']:+.0%} | "
            f"{r['source'].split(',')[0]} |"
        )
        if "ttft_ms" in r:
            print(
                f"|  |  |  |  |  | TTFT | {r['ttft_ms']:,.0f} ms | {r['predicted_ttft_ms']:,.0f} ms | "
                f"{r['predicted_ttft_ms'] / r['ttft_ms'] - 1:+.0%} | |"
            )


if __name__ == "__main__":
    main()
