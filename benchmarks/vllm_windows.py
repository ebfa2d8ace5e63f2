"""INT8 W8A8 in vLLM's CPU build against `eval ppl`, on one window and on twenty (issue 29).

`tests/test_vllm.py` compares the two engines on the first 2,048 tokens of `sotu:eval`; this
script scores the same checkpoints on that window and on the first 40,960 tokens (the
benchmarks' protocol) to tell a difference of the engines from the noise of one window:

- `ct-w8a8-dynamic`, `ct-w8a8-static`: the CI rows' checkpoints (`tests/vllm_formats.py`:
  `--scheme W8A8 --method rtn --ignore '*.down_proj'`, per-token or static per-tensor
  activations, the static one calibrated on 2 x 512 tokens of its calibration text);
- `w8a8-static-full`: static per-tensor activations with down_proj quantized too (RTN, 128 x 512
  tokens of `sotu:calib`).

For each: vLLM's ppl (bf16, `tests/vllm_worker.py` under PYTHON), ours in bf16 with the rounding
of vLLM's oneDNN kernel (what `eval ppl` picks on this CPU) and with the CUDA kernel's formula
(which rounds a few codes differently: a second, equally valid evaluation), and ours in fp32.

    python benchmarks/vllm_windows.py --vllm .venv-vllm/bin/python
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
    "w8a8-static-full": ("--scheme", "W8A8", "--method", "rtn", *STATIC, "--num-samples", "128", "--seq-len", "512"),
}


def quantize(name: str, out: Path, calib_text: Path) -> None:
    calib = ["--calib", str(calib_text)] if name.startswith("ct-") else ["--calib", "sotu:calib"]
    cmd = [bench.cli(), "quantize", vllm_formats.MODEL, *CONFIGS[name], *calib, "--out", str(out), "--no-progress"]
    subprocess.run(cmd, check=True, capture_output=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm", metavar="PYTHON", required=True, help="vLLM's interpreter (.venv-vllm)")
    p.add_argument("--vllm-timeout", type=float, default=1800)
    p.add_argument("--only", nargs="*", choices=list(CONFIGS), help="checkpoints to score (all by default)")
    args = p.parse_args()
    from infer_tool.calib.corpora import load_text

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-windows-") as tmp:
        calib_text = Path(tmp) / "calib.txt"  # tests/vllm_formats.py's calibration text
        calib_text.write_text(load_text("sotu:calib")[:40_000], encoding="utf-8")
        for name in args.only or CONFIGS:
            out = Path(tmp) / name
            quantize(name, out, calib_text)
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
