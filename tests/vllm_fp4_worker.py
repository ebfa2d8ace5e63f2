"""vLLM's side of the FP4 numerics parity test in tests/test_fp4.py: runs vLLM's own
NVFP4 emulation functions on tensors we give it. Runs under the vLLM environment's
Python and imports nothing of infer-tool:

    .venv-vllm/bin/python tests/vllm_fp4_worker.py IN.safetensors OUT.safetensors

IN holds `x.<name>` activations with `igs.<name>` (their float32 input global scale), and
`packed.<name>` / `scale.<name>` / `gs.<name>` NVFP4 weights (uint8 (N, K/2), float8_e4m3fn
(N, K/16), float32 (1,) as stored in a checkpoint). OUT gets `qdq.<name>` =
`ref_nvfp4_quant_dequant(x, igs, 16)` (vLLM's CPU activation path) and `w.<name>` =
`dequantize_to_dtype(packed, scale, 1 / gs, bfloat16, 16, swizzle=False)` (vLLM keeps
`1 / weight_global_scale` after loading, `compressed_tensors_w4a4_nvfp4.py`).
"""

from __future__ import annotations

import sys


def main(src: str, dst: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_to_dtype,
        ref_nvfp4_quant_dequant,
    )

    t = load_file(src)
    out = {}
    for key in t:
        kind, name = key.split(".", 1)
        if kind == "x":
            out[f"qdq.{name}"] = ref_nvfp4_quant_dequant(t[key], t[f"igs.{name}"], 16).contiguous()
        elif kind == "packed":
            inv = (1.0 / t[f"gs.{name}"].max()).to(torch.float32)
            out[f"w.{name}"] = dequantize_to_dtype(
                t[key], t[f"scale.{name}"], inv, torch.bfloat16, 16, swizzle=False
            ).contiguous()
    save_file(out, dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
