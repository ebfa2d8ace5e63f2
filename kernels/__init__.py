"""Fused Triton kernels for quantized inference, each with a pure-torch reference.

- `layout`       the canonical INT4 layout (int32 `(K/8, N)`, packed along K);
- `w4a16`        INT4 weight x fp16/bf16/fp32 activation GEMM (gemv / split-K / tiled);
- `fp8`          e4m3 weight GEMM, W8A8 (per-token activations) or W8A16;
- `quant_linear` `Int4Linear` / `Fp8Linear` modules and `backend_name(device)`;
- `backend`      Triton vs interpreter vs torch-reference dispatch, launches, AOT compile.

Nothing is imported here: `import infer_tool.kernels.<module>` what you need.
"""
