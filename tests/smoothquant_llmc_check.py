"""`packers/smoothquant.smoothquant_scales` next to llm-compressor's own
`SmoothQuantModifier._calculate_smoothing_scales` on the same tensors (a script, not a test:
it runs in llm-compressor's environment, which has no infer-tool; our module is loaded from its
file, it imports only torch):

    /work/envs/llmc/bin/python tests/smoothquant_llmc_check.py

llm-compressor takes each channel's activation range max(x) - min(x) (not max|x|) and twice the
weight maximum: s = (max - min)^α / (2 max|W|)^(1-α), floored at 1e-5, in the model's dtype.
For a channel with min = -max that is 2^(2α-1) times the paper's s, a constant factor per
mapping (it moves no information between channels). Printed, per α:
- `symmetric`: the largest relative difference between theirs and 2^(2α-1) x ours when the
  range is 2 max|x| (float32): float rounding;
- `measured`: on activations with a positive offset in some channels (as after a norm with a
  bias, or GELU/SiLU inputs), the spread of theirs / (2^(2α-1) x ours) over channels: what the
  range statistic changes;
- `bf16`: their factors computed from bf16 weights and statistics vs float32.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from llmcompressor.modifiers.transform.smoothquant.base import SmoothQuantModifier

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("smoothquant", HERE.parent / "packers" / "smoothquant.py")
ours = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ours)


def linears(weights: list[torch.Tensor]) -> list[torch.nn.Linear]:
    out = []
    for w in weights:
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        lin.weight.data.copy_(w)
        out.append(lin)
    return out


def main() -> None:
    g = torch.Generator().manual_seed(0)
    K = 256
    X = torch.randn(4096, K, generator=g)
    X[:, ::17] *= 40.0  # outlier channels
    X[:, 1::5] += 3.0  # channels with a positive offset: range < 2 max|x|
    weights = [torch.randn(n, K, generator=g) * 0.05 for n in (128, 64, 64)]
    x_max = X.abs().amax(dim=0)
    report = {}
    for alpha in (0.5, 0.8):
        sq = SmoothQuantModifier(smoothing_strength=alpha)
        mine = ours.smoothquant_scales(x_max, weights, alpha) * 2 ** (2 * alpha - 1)
        sym = sq._calculate_smoothing_scales(linears(weights), 2 * x_max).clamp_min(1e-5)
        ratio = sq._calculate_smoothing_scales(linears(weights), X.amax(0) - X.amin(0)).clamp_min(1e-5) / mine
        bf16 = sq._calculate_smoothing_scales(
            linears([w.bfloat16() for w in weights]), (X.amax(0) - X.amin(0)).bfloat16()
        ).float()
        f32 = sq._calculate_smoothing_scales(linears(weights), X.amax(0) - X.amin(0))
        report[f"alpha={alpha}"] = {
            "symmetric_max_rel": float(((sym - mine).abs() / mine).max()),
            "measured_ratio_min": float(ratio.min()),
            "measured_ratio_max": float(ratio.max()),
            "offset_channels_ratio_mean": float(ratio[1::5].mean()),
            "bf16_vs_f32_max_rel": float(((bf16 - f32).abs() / f32).max()),
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    with torch.no_grad():
        main()
