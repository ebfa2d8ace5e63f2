"""Evaluation: perplexity (`ppl`, its cache `ppl_cache`) and loading models as they are
evaluated (`load_model` for any model spec, `load_quantized` for this tool's checkpoints,
`fp8_in_memory` for an FP8 model before it is written)."""
