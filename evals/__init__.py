"""Evaluation: perplexity (`ppl`, its cache `ppl_cache`) and loading models as they are
evaluated (`load_model` for any model spec, `load_quantized` for this tool's checkpoints,
the formats' `deployed` modules run an in-memory model before it is written)."""
