"""The PyPI auto-round side of `benchmarks/quantize.py --autoround PYTHON`.

Runs under a Python that has auto-round installed (0.16.1: `pip install torch==2.13.0
auto-round==0.16.1`, in its own venv), so it imports nothing of infer-tool:

    PYTHON benchmarks/autoround_pypi.py --model-dir DIR --ids calib.safetensors \\
        --group-size 64 [--asym] --iters 200 --batch 8 --out OUT [--amp]

The calibration sequences are the exact token ids infer-tool calibrates on (`input_ids`
(B, T) int64 in a safetensors file), handed to `AutoRound` as a list of (1, T) tensors with
`nsamples = B` and `seqlen = T`, so both sides tune on the same data. The model is loaded in
float32 and, unless `--amp`, tuned in float32 (`amp=False`: on a CPU auto-round otherwise
casts the model to bfloat16 for tuning). Everything else is auto-round's default for
W4A16 (lr 1/iters with its linear decay, min-max tuning, quantized block inputs, best
iteration by batch loss, seed 42). The checkpoint is written in a format `infer-tool eval
ppl` and `eval kld` read: auto-round's `auto_gptq` (GPTQ v1) when symmetric, `auto_awq` (AWQ
GEMM) when asymmetric (its `llm_compressor` format would need compressed-tensors in that
venv). Prints one JSON line: seconds (quantize, save), peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--ids", required=True)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--asym", action="store_true")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--lr", type=float, default=None, help="default: auto-round's (1/iters)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--amp", action="store_true", help="tune in bfloat16 (auto-round's CPU default)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch
    from auto_round import AutoRound
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    ids = load_file(args.ids)["input_ids"]
    n, seq_len = ids.shape
    dataset = [ids[i : i + 1].clone() for i in range(n)]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    t0 = time.perf_counter()
    ar = AutoRound(
        model,
        tok,
        scheme="W4A16",
        bits=4,
        group_size=args.group_size,
        sym=not args.asym,
        dataset=dataset,
        iters=args.iters,
        lr=args.lr,
        nsamples=n,
        seqlen=seq_len,
        batch_size=args.batch,
        device_map="cpu",
        enable_torch_compile=False,
        amp=args.amp,
    )
    ar.quantize()
    t1 = time.perf_counter()
    ar.save_quantized(args.out, format="auto_awq" if args.asym else "auto_gptq", inplace=True)
    t2 = time.perf_counter()
    print(
        json.dumps(
            {
                "quantize_s": t1 - t0,
                "save_s": t2 - t1,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            }
        )
    )


if __name__ == "__main__":
    main()
