"""On-disk formats of quantized linears, one module per format: a `CheckpointFormat` (config,
tensors, reader, `matches`) each, registered by the number format that uses it
(`formats/<format>/__init__.py`, `codecs`): compressed-tensors `pack-quantized`
(`compressed_tensors.py`), `int-quantized` (`int_quantized.py`), the FP4 `*-pack-quantized`
(`fp4_format.py`), FP8 `float-quantized` and native `fp8` (`fp8_formats.py`), AutoAWQ's GEMM
(`awq_gemm.py`), AutoGPTQ's v1 (`gptq_v1.py`); a checkpoint of several of them
(`mixed_precision.py`); and, read only, ModelOpt's NVFP4 export (`modelopt_nvfp4.py`,
`modelopt_config.py`). The solvers sit one level up (`packers/`).
"""
