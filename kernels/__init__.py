"""Fused Triton kernels for quantized inference, each with a pure-torch reference.

- `layout`       the canonical INT4 layout (int32 `(K/8, N)`, packed along K);
- `w4_layout`    planar-128, the INT4 layout the W4A16 kernels read (repacked once per layer);
- `w4a16`        INT4 weight x fp16/bf16/fp32 activation GEMM (gemv / split-K / tiled);
- `fp8`          e4m3 weight GEMM, W8A8 (per-token activations) or W8A16 (gemv / dot);
- `fp4`          NVFP4 / MXFP4 weights-only GEMM;
- `splitk`       split-K reduced in the same launch (serial, fixed order);
- `tuning`       launch configs tuned on a GPU, stored per GPU in `tuned/<gpu>.json`;
- `ops`          the products as `torch.library` custom ops (torch.compile, CUDA graphs);
- `quant_linear` `Int4Linear` / `Int8Linear` / `Fp8Linear` / `Fp4Linear` modules and `backend_name(device)`;
- `backend`      Triton vs interpreter vs torch-reference dispatch, launches, AOT compile.

Nothing is imported here: `import infer_tool.kernels.<module>` what you need.
"""
