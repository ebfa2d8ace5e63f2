"""Where AutoRound's descent spends its time, tuned in float32 and in bfloat16 (`--tune-dtype`),
on one decoder block of the demo model: seconds per step (median over runs), and the share
the profiler gives GEMMs (with their rate), attention and the rest.

    python benchmarks/autoround_step.py                 # block 0 of smollm2-135m, 8 x 512 tokens a step
    python benchmarks/autoround_step.py --layer 15 --steps 8 --runs 5

It calls the quantizer's own descent (`AutoRoundQuantizer.tune`, `--steps` iterations) on the
block's inputs as the pipeline holds them (`calib/layers.capture_inputs`, then the fp blocks
before it): the hidden states of `--num-samples` windows of `sotu:calib` in chunks of
`CPU_BATCH_TOKENS` tokens, with the arguments the model passes each block, and the fp block's
outputs as targets. Each step is the block's
forward and backward on `--batch` sequences, the chain rule through the quantizer and the signed
step; the set-up before the first step (grouping the weights) is timed with it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--num-samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="descent steps per run")
    p.add_argument("--runs", type=int, default=3, help="timed runs per dtype (the median is printed)")
    args = p.parse_args()

    from infer_tool.calib.architectures import architecture_for
    from infer_tool.calib.corpora import calibration_batch
    from infer_tool.calib.layers import capture_inputs, decoder_layers, run_layer
    from infer_tool.calib.models import load_model
    from infer_tool.calib.pipeline import CPU_BATCH_TOKENS
    from infer_tool.calib.quantizers.autoround import AutoRoundQuantizer
    from infer_tool.calib.quantizers.base import LayerContext
    from infer_tool.calib.result import PipelineResult
    from infer_tool.schemes.integer import AutoRoundScheme

    loaded = load_model(args.model)
    model = loaded.model
    arch = architecture_for(model.config.model_type, model.config)
    layers = decoder_layers(model, arch)
    ids = calibration_batch(loaded.tokenizer, "sotu:calib", args.num_samples, args.seq_len, 0)
    X, calls_per_layer = capture_inputs(model, arch, ids, max(1, CPU_BATCH_TOKENS // args.seq_len), torch.device("cpu"))
    for i in range(args.layer):  # the fp model's inputs of block `--layer`
        X = run_layer(layers[i], X, calls_per_layer[i])
    layer, prefix, calls = layers[args.layer], f"model.layers.{args.layer}", calls_per_layer[args.layer]
    Y_fp = run_layer(layer, X, calls)
    arch = arch.for_layer(layer)
    targets = {f"{prefix}.{n}" for n in arch.linears}
    quantizer = AutoRoundQuantizer()

    def tune(dtype: str, steps: int) -> None:
        scheme = AutoRoundScheme(group_size=args.group_size, iters=steps, batch=args.batch, tune_dtype=dtype)
        ctx = LayerContext(
            layer,
            prefix,
            X,
            calls,
            arch=arch,
            targets=targets,
            result=PipelineResult(),
            error_chunks=len(X),
            search_chunks=len(X),
            Y_fp=Y_fp,
        )
        quantizer.tune(ctx, [n for n in ctx.linears if ctx.is_target(n)], scheme)

    rows = []
    for dtype in ("float32", "bfloat16"):
        tune(dtype, 1)  # warm-up
        per_step = []
        for _ in range(args.runs):
            t = time.perf_counter()
            tune(dtype, args.steps)
            per_step.append((time.perf_counter() - t) / args.steps)
        with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
            tune(dtype, args.steps)
        gemm = attention = total = flops = 0.0
        for e in prof.key_averages():
            total += e.self_cpu_time_total
            if e.key in GEMMS:
                gemm += e.self_cpu_time_total
                flops += e.flops
            elif "scaled_dot_product" in e.key:
                attention += e.self_cpu_time_total
        rows.append((dtype, statistics.median(per_step), gemm, attention, total, flops / args.steps))

    print(
        f"{args.model} {prefix}: AutoRound steps on {args.batch} x {args.seq_len} tokens, group {args.group_size}, "
        f"{args.steps} steps a run; torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(
        f"| tuning dtype | s per step (median of {args.runs} runs) | vs float32 | GEMM GFLOP per step | GEMM share "
        "| GEMM GFLOP/s | attention share | other share |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for dtype, seconds, gemm, attention, total, flops in rows:
        other = total - gemm - attention
        print(
            f"| {dtype} | {seconds:.3f} | {seconds / rows[0][1]:.2f}x | {flops / 1e9:.1f} | {gemm / total:.0%} | "
            f"{flops * args.steps / gemm / 1e3:.0f} | {attention / total:.0%} | {other / total:.0%} |"
        )


if __name__ == "__main__":
    main()
