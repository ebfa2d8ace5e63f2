"""Peak host memory of `infer-tool quantize` against model size (issue 15): streamed, it
should not grow with the number of layers; loaded whole (--no-stream), it does.

Llama-shaped models with random N(0, 0.02) weights, one width (hidden 1024, MLP 4096, 8
heads, 67 MB of fp32 a layer) and 2 to 48 layers (0.13 to 3.2 GB of safetensors), are
written one tensor at a time, then quantized, one process at a time: RTN w4 g128 (data
free: only the 16 sequences behind the reported error run through the layers), streamed
and, up to --whole-max-gb, loaded whole. Each row: weights on disk, the process's peak
RSS (the report's ru_maxrss), the pre-flight estimate, quantize and process seconds. The
slope of peak RSS against size comes from a least-squares line; a terminal plot follows.

    python benchmarks/streaming_memory.py                      # 2 6 12 24 48 layers
    python benchmarks/streaming_memory.py --layers 2 12 --whole-max-gb 1 --json rows.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, INTER, HEADS = 1024, 4096, 8


def write_model(path: Path, layers: int) -> int:
    """A random Llama of `layers` layers in `path` (safetensors + config + tokenizer); its bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny import make_tokenizer

    from infer_tool.packers.safetensors_stream import TensorSpec, write_streamed

    tok = make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    specs = [TensorSpec(n, torch.float32, tuple(t.shape)) for n, t in model.state_dict().items()]
    shapes = {s.name: s.shape for s in specs}
    g = torch.Generator().manual_seed(layers)

    def load(name: str) -> torch.Tensor:
        return (
            torch.ones(shapes[name]) if name.endswith("norm.weight") else torch.randn(shapes[name], generator=g) * 0.02
        )

    path.mkdir(parents=True)
    write_streamed(path / "model.safetensors", specs, load, {"format": "pt"})
    config.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(s.nbytes for s in specs)


def quantize(model: Path, out: Path, calib: Path, stream: bool, method: str) -> dict:
    cli = str(Path(sys.executable).parent / "infer-tool")
    cmd = [
        cli,
        "quantize",
        str(model),
        "--out",
        str(out),
        "--calib",
        str(calib),
        "--method",
        method,
        "--group-size",
        "128",
        "--device",
        "cpu",
        "--json",
        "--no-progress",
        "--max-memory",
        "1000GiB",
        "--stream" if stream else "--no-stream",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-1500:]}")
    r = json.loads(proc.stdout)
    shutil.rmtree(out)
    return {
        "peak_rss_mib": r["memory"]["peak_rss_mib"],
        "estimate_mib": r["memory"]["estimate_host_mib"],
        "quantize_s": r["seconds"]["quantize"],
        "process_s": wall,
    }


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y against x."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def plot(series: dict[str, list[tuple[float, float]]], width: int = 60, height: int = 16) -> str:
    """A terminal scatter plot: x = weights GB, y = peak RSS MiB; one mark per series."""
    pts = [p for s in series.values() for p in s]
    x1, y1 = max(x for x, _ in pts), max(y for _, y in pts)
    grid = [[" "] * (width + 1) for _ in range(height + 1)]
    marks = {}
    for mark, (name, s) in zip("o*+x", series.items()):
        marks[mark] = name
        for x, y in s:
            grid[height - round(y / y1 * height)][round(x / x1 * width)] = mark
    lines = [f"{y1 * (height - r) / height:7.0f} |" + "".join(row) for r, row in enumerate(grid)]
    lines.append(" " * 8 + "+" + "-" * (width + 1))
    lines.append(" " * 8 + f"0{'weights on disk, GB':^{width - 8}}{x1:.1f}")
    lines.append("peak RSS MiB; " + ", ".join(f"{m} {n}" for m, n in marks.items()))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 6, 12, 24, 48])
    p.add_argument("--whole-max-gb", type=float, default=1.7, help="--no-stream rows up to this size")
    p.add_argument("--method", default="rtn")
    p.add_argument("--json", help="append each row to this JSON-lines file")
    args = p.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-streaming-") as tmp:
        work = Path(tmp)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from tiny import TEXT

        calib = work / "calib.txt"
        calib.write_text(TEXT * 200)
        for layers in args.layers:
            model = work / f"llama-{layers}"
            size = write_model(model, layers)
            for stream in (True, False):
                if not stream and size / 1e9 > args.whole_max_gb:
                    continue
                row = {
                    "layers": layers,
                    "weights_gb": size / 1e9,
                    "mode": "streamed" if stream else "whole",
                    "load_avg": os.getloadavg()[0],
                    **quantize(model, work / "out", calib, stream, args.method),
                }
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
            shutil.rmtree(model)

    print(f"RTN w4 g128 on random Llamas (hidden {HIDDEN}, MLP {INTER}), one process per row, {os.cpu_count()} CPUs")
    print("| layers | weights GB | mode | peak RSS MiB | estimate MiB | quantize s | process s | load avg |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['layers']} | {r['weights_gb']:.2f} | {r['mode']} | {r['peak_rss_mib']:.0f} | "
            f"{r['estimate_mib']:.0f} | "
            f"{r['quantize_s']:.0f} | {r['process_s']:.0f} | {r['load_avg']:.1f} |"
        )
    series = {
        mode: [(r["weights_gb"], r["peak_rss_mib"]) for r in rows if r["mode"] == mode]
        for mode in ("streamed", "whole")
    }
    series = {k: v for k, v in series.items() if v}
    for mode, pts in series.items():
        if len(pts) > 1:
            print(
                f"{mode}: peak RSS grows {slope(pts):.0f} MiB per GB of weights "
                f"({min(y for _, y in pts):.0f} to {max(y for _, y in pts):.0f} MiB)"
            )
    print(plot(series))


if __name__ == "__main__":
    main()
