"""Where the main job's time goes: `infer-tool quantize` on its demo defaults (smollm2-135m,
AWQ asym g64, 32 x 512 calibration tokens, ppl on 8,192 tokens before and after), run
in-process with timers around its stages.

    python benchmarks/demo_profile.py [--num-samples 32] [--layers N] [--awq-search full|fast|screen]

Timers are inclusive and wrap the library functions the job calls (nothing in the job is
changed): the model load, tokenizing, the two perplexity runs, the whole layer loop, and
inside it the layer passes (statistics + propagation), AWQ's scale search (split into the
block forwards it runs, the fake quantization of candidates and the Gram-matrix losses),
the clip search and the rest. `--layers N` quantizes only the first N decoder layers (the
others are left fp) for a quicker look. Prints a table and the load average.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

TIMES: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def timed(label: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[label] += time.perf_counter() - t
            CALLS[label] += 1

    return wrapper


def patch(module: Any, name: str, label: str) -> None:
    setattr(module, name, timed(label, getattr(module, name)))


def instrument() -> None:
    import infer_tool.calib.corpora as corpora
    import infer_tool.calib.models as models
    import infer_tool.calib.quantizers.awq as qawq
    import infer_tool.evals.ppl as ppl
    import infer_tool.packers.awq as pawq
    import infer_tool.packers.checkpoint as checkpoint

    patch(models, "load_model", "load model")
    patch(corpora, "tokenize", "tokenize (eval + calibration corpora)")
    patch(ppl, "evaluate_ppl", "perplexity (before + after)")
    patch(checkpoint, "write_checkpoint", "write checkpoint")
    patch(qawq, "run_layer", "  layer passes (statistics + propagation)")
    patch(qawq, "awq_search_clip", "  clip search")
    patch(qawq, "quantize_rtn", "  RTN of the clipped weights")
    patch(pawq, "fake_quantize", "    fake quantization of candidates")
    patch(pawq, "linear_output_mse", "    loss from XᵀX (up -> down)")
    search = qawq.awq_search_scale

    def search_with_timed_forward(x_abs_mean: Any, weights: Any, forward: Any, *args: Any, **kwargs: Any) -> Any:
        if forward is not None:
            forward = timed("    block forwards of candidates", forward)
        if kwargs.get("screen") is not None:
            forward_lo, reference_lo = kwargs["screen"]
            kwargs["screen"] = (timed("    bfloat16 block forwards (the screen)", forward_lo), reference_lo)
        return search(x_abs_mean, weights, forward, *args, **kwargs)

    qawq.awq_search_scale = timed("  scale search", search_with_timed_forward)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-samples", type=int, default=None, help="default: the demo's")
    ap.add_argument("--layers", type=int, default=None, help="quantize only the first N decoder layers")
    ap.add_argument("--awq-search", choices=("full", "fast", "screen"), default=None, help="default: the scheme's")
    args = ap.parse_args()

    instrument()
    import infer_tool.calib.pipeline as pipeline
    from infer_tool.calib.recipe import QuantizeOptions, apply_demo
    from infer_tool.jobs.quantize import quantize

    opts = apply_demo(QuantizeOptions(), set())
    if args.num_samples:
        opts.num_samples = args.num_samples
    if args.awq_search:  # a scheme option added with the fast search
        opts.awq_search = args.awq_search
    if args.layers is not None:
        ignore = tuple(f"model.layers.{i}.*" for i in range(args.layers, 64))
        opts.ignore = ignore
    pipeline.LayerLoop.run = timed("layer loop (calibrate + quantize)", pipeline.LayerLoop.run)
    with tempfile.TemporaryDirectory(prefix="demo-profile-") as tmp:
        opts.out = str(Path(tmp) / "ckpt")
        t = time.perf_counter()
        report = quantize(opts)
        total = time.perf_counter() - t
    load = os.getloadavg()
    print(
        f"demo job: {opts.model}, {report.scheme_description}, {opts.num_samples} x {opts.seq_len} calibration tokens, "
        f"ppl on {opts.eval_tokens} tokens; load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
        f"on {os.cpu_count()} cores"
    )
    if report.eval:
        print(f"ppl {report.eval.ppl_before:.4f} -> {report.eval.ppl_after:.4f}")
    print("| stage | s | share | calls |")
    print("|---|---:|---:|---:|")
    print(f"| job total | {total:.1f} | 100% | 1 |")
    for label, s in TIMES.items():
        print(f"| {label} | {s:.1f} | {s / total:.0%} | {CALLS[label]} |")
    print("report seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in report.seconds.items()))


if __name__ == "__main__":
    main()
