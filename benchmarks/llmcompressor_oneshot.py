"""llm-compressor's side of `benchmarks/quantize.py --llmcompressor PYTHON`.

Runs under a Python that has llm-compressor installed (its pins differ from ours:
transformers <= 5.17, compressed-tensors 0.19), so it imports nothing of infer-tool:

    PYTHON benchmarks/llmcompressor_oneshot.py --model-dir DIR --ids calib.safetensors \\
        --method awq|gptq --group-size 64 [--asym] --out OUT
    PYTHON benchmarks/llmcompressor_oneshot.py ... --scheme NVFP4A16 --method rtn|gptq|awq --out OUT
    PYTHON benchmarks/llmcompressor_oneshot.py --model-dir DIR --ids calib.safetensors \\
        --method w8a8 [--smoothquant 0.8] [--gptq | --rtn] --out OUT

The calibration sequences are the exact token ids infer-tool calibrates on (`input_ids`
(B, T) int64 in a safetensors file), so both sides see the same data. llm-compressor
runs its defaults for the method (AWQ: 20-point grid, duo scaling; GPTQ: damp 0.01,
128-column blocks, static act-order) with an int4 weight-only scheme of the given group
size on every Linear but lm_head, and saves a compressed-tensors pack-quantized
checkpoint. With `--scheme PRESET` (llm-compressor's preset names, e.g. NVFP4A16, NVFP4,
MXFP4A16) the preset replaces the int4 scheme, and `--method rtn` is its QuantizationModifier
alone (the presets' own observers: min-max weights, static min-max NVFP4 activations).
`--method w8a8` is its W8A8 INT8 recipe (examples/quantization_w8a8_int8):
`SmoothQuantModifier(smoothing_strength=ALPHA)` (with --smoothquant; mappings from the
architecture) then `GPTQModifier(scheme="W8A8")` (or `QuantizationModifier`, RTN, with
--rtn), saved as compressed-tensors int-quantized. Prints one JSON line: seconds (oneshot,
save), peak RSS.
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
    p.add_argument("--method", choices=("awq", "gptq", "rtn", "w8a8"), required=True)
    p.add_argument("--scheme", help="an llm-compressor preset name (NVFP4A16, NVFP4, MXFP4A16, ...) instead of int4")
    p.add_argument("--smoothquant", type=float, help="w8a8: SmoothQuantModifier(smoothing_strength=ALPHA) first")
    p.add_argument("--rtn", action="store_true", help="w8a8: QuantizationModifier (RTN) instead of GPTQModifier")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--asym", action="store_true")
    p.add_argument("--act-order", choices=("static", "none"), default="static", help="GPTQ only")
    p.add_argument(
        "--ignore",
        nargs="*",
        default=[],
        help="more modules to leave unquantized besides lm_head (llm-compressor patterns, e.g. MoE routers)",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not torch.cuda.is_available():
        # llm-compressor 0.14's AWQ pins its cached activations for faster host-to-device
        # copies, which raises on a machine without an accelerator; pinning changes no value.
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *a, **k: None

    ids = load_file(args.ids)["input_ids"]
    n, seq_len = ids.shape
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    weights = QuantizationArgs(
        num_bits=4, type="int", strategy="group", group_size=args.group_size, symmetric=not args.asym
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    ignore = ["lm_head", *args.ignore]
    # the quantization the modifiers apply: the int4 group scheme, or a preset by name
    quant = {"targets": ["Linear"], "scheme": args.scheme} if args.scheme else {"config_groups": {"group_0": scheme}}
    from llmcompressor.modifiers.quantization import QuantizationModifier

    if args.method == "w8a8":
        from llmcompressor.modifiers.gptq import GPTQModifier
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

        recipe = [SmoothQuantModifier(smoothing_strength=args.smoothquant)] if args.smoothquant is not None else []
        solver = QuantizationModifier if args.rtn else GPTQModifier
        recipe.append(solver(targets="Linear", scheme="W8A8", ignore=ignore))
    elif args.method == "awq":
        from llmcompressor.modifiers.transform.awq import AWQModifier

        recipe = [AWQModifier(), QuantizationModifier(**quant, ignore=ignore)]
    elif args.method == "rtn":
        recipe = [QuantizationModifier(**quant, ignore=ignore)]
    else:
        from llmcompressor.modifiers.gptq import GPTQModifier

        kw = {} if args.act_order == "static" else {"actorder": None}
        recipe = [GPTQModifier(**quant, ignore=ignore, **kw)]

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    t0 = time.perf_counter()
    oneshot(
        model=model,
        dataset=ds,
        recipe=recipe,
        num_calibration_samples=n,
        max_seq_length=seq_len,
        shuffle_calibration_samples=False,
    )
    t1 = time.perf_counter()
    model.save_pretrained(args.out, save_compressed=True)
    tok.save_pretrained(args.out)
    t2 = time.perf_counter()
    print(
        json.dumps(
            {
                "oneshot_s": t1 - t0,
                "save_s": t2 - t1,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
                "llmcompressor": __import__("llmcompressor").__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
