"""The time of vLLM's CPU oneDNN W8A8 linear with static (per-tensor) against dynamic
(per-token) int8 activations, as `CPUInt8ScaledMMLinearKernel._apply_weights_onednn` runs it:
`onednn_scaled_int8_quant` then `onednn_scaled_mm`, bfloat16 in and out, symmetric activations
(a static symmetric layer passes no azp adjustment, as vLLM's weight processing leaves it).

Runs under a Python that has vLLM installed (its pins differ from ours), so it imports
nothing of infer-tool:

    VLLM_PYTHON benchmarks/vllm_int8_gemm.py [--k 576] [--n 576] [--m 16 256 2048] [--runs 3]

Prints a table: per token count M, the median of `--runs` calls of each kind (after one
warm-up call) and static / dynamic.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=576, help="input features (the demo model's hidden size)")
    p.add_argument("--n", type=int, default=576, help="output features")
    p.add_argument("--m", type=int, nargs="+", default=[16, 256, 2048], help="tokens per call")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()

    import torch
    import vllm
    from vllm import _custom_ops as ops

    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (args.n, args.k), generator=g, dtype=torch.int8)
    w_s = (torch.rand(args.n, 1, generator=g) * 0.01 + 0.001).float()
    wt = w.t()  # (K, N), as vLLM hands it to oneDNN

    def timed(x: torch.Tensor, static: bool) -> float:
        i_s = torch.tensor(0.05, dtype=torch.float32) if static else None
        handler = ops.create_onednn_scaled_mm(wt, w_s, x.dtype, i_s is None, False, 32)
        azp_adj = None if static else wt.sum(dim=0, keepdim=True, dtype=torch.float32) * w_s.squeeze()

        def call() -> None:
            x_q, x_s, x_zp = ops.onednn_scaled_int8_quant(x, i_s, None, True)
            out = torch.empty((x.shape[0], handler.n), dtype=x.dtype)
            ops.onednn_scaled_mm(handler, x_q, out, x_s, x_zp, azp_adj, None)

        call()
        ts = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    print(
        f"vLLM {vllm.__version__}, torch {torch.__version__}, K={args.k}, N={args.n}, "
        f"VNNI {torch.cpu._is_vnni_supported()}, AMX {torch.cpu._is_amx_tile_supported()}"
    )
    print("| M | dynamic ms | static ms | static / dynamic |")
    print("|---:|---:|---:|---:|")
    for m in args.m:
        x = (torch.randn(m, args.k, generator=g) * 3.0).to(torch.bfloat16)
        dyn, sta = timed(x, False), timed(x, True)
        print(f"| {m} | {dyn * 1e3:.2f} | {sta * 1e3:.2f} | {sta / dyn:.0f} |", flush=True)


if __name__ == "__main__":
    main()
