"""`quantize --model-free` on a checkpoint no library knows: peak RSS and throughput.

Writes a synthetic checkpoint under --work (default a fresh directory in /tmp, deleted at the
end unless --keep): an invented `model_type` ("zebra_moe", unknown to transformers and to our
architecture table), bf16, several safetensors shards with an index, each decoder layer with
q/k/v/o projections, a router and transformers-style fused 3-D experts
(`mlp.experts.gate_up_proj (E, 2I, H)`, `mlp.experts.down_proj (E, H, I)`), plus one MTP layer
(`num_nextn_predict_layers: 1`, stored as layer `num_hidden_layers`, kept by default) with
its `eh_proj`. Random normal weights (std 0.02), seeded per tensor name.

Then, per scheme (NVFP4A16, FP8_BLOCK), `infer-tool quantize CKPT --model-free --scheme S`
runs --runs times in a fresh process each (`--threads N`: its OMP_NUM_THREADS); the table shows the
median of the report's figures: input MB/s over the run (MB = 10^6 bytes), wall seconds, the
process's CPU seconds (user + system) and peak RSS (ru_maxrss, the interpreter and torch
included). A read-only pass (every tensor read once, as
the job reads them, and dropped) and the solver alone on one expert's gate/up slice show what
bounds the throughput: the disk / page cache, or the rounding.

    .venv/bin/python benchmarks/model_free.py [--gb 4.2] [--runs 3] [--schemes NVFP4A16 FP8_BLOCK]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

H, I, E, HEADS_KV = 2048, 768, 16, 4  # hidden, expert intermediate, experts, KV heads of 128
VOCAB = 32000


def layer_tensors(i: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}"
    kv = HEADS_KV * 128
    return {
        f"{p}.input_layernorm.weight": (H,),
        f"{p}.post_attention_layernorm.weight": (H,),
        f"{p}.self_attn.q_proj.weight": (H, H),
        f"{p}.self_attn.k_proj.weight": (kv, H),
        f"{p}.self_attn.v_proj.weight": (kv, H),
        f"{p}.self_attn.o_proj.weight": (H, H),
        f"{p}.mlp.gate.weight": (E, H),
        f"{p}.mlp.experts.gate_up_proj": (E, 2 * I, H),
        f"{p}.mlp.experts.down_proj": (E, H, I),
    }


def layout(gb: float) -> tuple[int, list[dict[str, tuple[int, ...]]]]:
    """(decoder layers, shards as {tensor: shape}) of about `gb` GB in bf16."""
    per_layer = sum(2 * _numel(s) for s in layer_tensors(0).values())
    fixed = 2 * 2 * VOCAB * H
    layers = max(2, round((gb * 1e9 - fixed) / per_layer) - 1)  # one more: the MTP layer
    shards: list[dict[str, tuple[int, ...]]] = [
        {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,), "lm_head.weight": (VOCAB, H)}
    ]
    for i in range(layers + 1):
        t = layer_tensors(i)
        if i == layers:  # DeepSeek-V3's MTP layout
            t |= {f"model.layers.{i}.eh_proj.weight": (H, 2 * H), f"model.layers.{i}.enorm.weight": (H,)}
        if sum(2 * _numel(s) for s in shards[-1].values()) > 0.9e9:
            shards.append({})
        shards[-1] |= t
    return layers, shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_checkpoint(path: Path, gb: float) -> int:
    """The synthetic checkpoint; returns its bytes."""
    import zlib

    import torch

    from infer_tool.packers.safetensors_stream import TensorSpec, write_streamed

    layers, shards = layout(gb)
    path.mkdir(parents=True)
    weight_map, total = {}, 0
    for j, shard in enumerate(shards):
        name = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        specs = [TensorSpec(n, torch.bfloat16, s) for n, s in shard.items()]

        def load(n: str, shard: dict = shard) -> torch.Tensor:
            g = torch.Generator().manual_seed(zlib.crc32(n.encode()))
            if n.endswith("norm.weight"):
                return torch.ones(shard[n], dtype=torch.bfloat16)
            return (torch.randn(shard[n], generator=g) * 0.02).to(torch.bfloat16)

        write_streamed(path / name, specs, load, {"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        total += sum(s.nbytes for s in specs)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {
        "model_type": "zebra_moe",
        "architectures": ["ZebraMoeForCausalLM"],
        "hidden_size": H,
        "moe_intermediate_size": I,
        "n_routed_experts": E,
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": 1,
        "vocab_size": VOCAB,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return total


def read_only(path: Path) -> float:
    """MB/s of reading every tensor once, as the job reads them (positioned reads)."""
    from infer_tool.common.safetensors_header import tensor_headers
    from infer_tool.packers.safetensors_stream import read_tensors

    t, n = time.perf_counter(), 0
    for f in sorted(path.glob("*.safetensors")):
        for name in tensor_headers(f)[0]:
            x = read_tensors(f, [name])[name]
            n += x.numel() * x.element_size()
            del x
    return n / 1e6 / (time.perf_counter() - t)


def solver_only(scheme: str) -> float:
    """MB/s (bf16 input) of the scheme's solver and writer on one expert's gate/up slice (2I, H)."""
    import torch

    from infer_tool.calib.recipe import QuantizeOptions, scheme_from_options, with_preset
    from infer_tool.jobs.model_free_formats import TensorCodec

    values = with_preset({"scheme": scheme, "method": None})
    values["method"] = values.get("method") or "rtn"
    codec = TensorCodec.open(scheme_from_options(QuantizeOptions(**values)), "bfloat16")
    w = (torch.randn(2 * I, H, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    gs = codec.global_scale([w])
    codec.quantize("x", w, gs)
    t = time.perf_counter()
    for _ in range(3):
        codec.quantize("x", w, gs)
    return 3 * w.numel() * 2 / 1e6 / (time.perf_counter() - t)


def run_once(ckpt: Path, out: Path, scheme: str, threads: int | None = None) -> dict:
    """One `quantize --model-free` in a fresh process (`threads`: its OMP_NUM_THREADS, torch's
    intra-op threads; None: torch's default, one per core). cpu_s: the process's user + system."""
    import resource

    cli = Path(sys.executable).with_name("infer-tool")
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run(
        [
            str(cli),
            "quantize",
            str(ckpt),
            "--model-free",
            "--scheme",
            scheme,
            "--out",
            str(out),
            "--json",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"quantize --model-free --scheme {scheme} exited {r.returncode}: {r.stderr[-2000:]}")
    report = json.loads(r.stdout)
    shutil.rmtree(out)
    return {
        "mb_s": report["mb_per_s"],
        "wall_s": wall,
        "rss_mib": report["peak_rss_mib"],
        "in_mb": report["bytes_in"] / 1e6,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=4.2, help="checkpoint size in GB (bf16)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--schemes", nargs="+", default=["NVFP4A16", "FP8_BLOCK"])
    p.add_argument("--work", type=Path, default=None, help="directory for the checkpoint (default: a new one in /tmp)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS of each run (default: torch's, one per core); 1 avoids spin-waiting on a shared machine",
    )
    p.add_argument("--keep", action="store_true", help="keep the checkpoint (a later run with --work reuses it)")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="model-free-bench-"))
    ckpt = work / "zebra"
    try:
        t = time.perf_counter()
        if (ckpt / "config.json").is_file():  # kept from an earlier --keep run
            size = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
        else:
            size = write_checkpoint(ckpt, args.gb)
        print(
            f"checkpoint: {size / 1e9:.2f} GB bf16 in {len(list(ckpt.glob('*.safetensors')))} shards, "
            f"written in {time.perf_counter() - t:.0f}s; load average {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        print(f"read-only pass: {read_only(ckpt):.0f} MB/s", flush=True)
        rows = []
        for scheme in args.schemes:
            solver = solver_only(scheme)
            runs = [run_once(ckpt, work / "out", scheme, args.threads) for _ in range(args.runs)]
            rows.append((scheme, solver, runs))
            print(json.dumps({"scheme": scheme, "solver_mb_s": solver, "runs": runs}), flush=True)
        threads = args.threads or "default"
        print("\n| scheme | threads | runs | input MB/s | wall s | CPU s | peak RSS MiB | solver alone MB/s |")
        print("|---|---|---|---|---|---|---|---|")
        for scheme, solver, runs in rows:
            med = {k: statistics.median(r[k] for r in runs) for k in ("mb_s", "wall_s", "cpu_s", "rss_mib")}
            print(
                f"| {scheme} | {threads} | {len(runs)} | {med['mb_s']:.1f} | {med['wall_s']:.1f} | {med['cpu_s']:.1f} "
                f"| {med['rss_mib']:.0f} | {solver:.1f} |"
            )
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
