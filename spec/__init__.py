"""Speculative decoding: measure how well drafts serve a target, predict and project the speedup.

- `sampling`: the speculative-sampling step (warp, verify); `acceptance`: β and α from probability rows;
- `cached_lm`: batch-1 passes with a rollback-able KV cache; `drafts`: model, prompt-lookup and suffix drafts;
- `decode`: plain and speculative decoding loops; `costs`: round costs, timed or projected;
- `batched`: the same loops over a batch of sequences; `batch_table`: the k-per-batch-size table they measure;
- `predict`: expected speedups and vLLM's metrics; `ranking`: best k and the order of drafts;
- `roofline` and `projection`: the same acceptance with sizing's roofline costs on a GPU type;
- `inputs`: prompts and draft specs; `profile`: the passes of one profile; `report`: a report read back
  for `kv-budget --spec-profile`; `ascii_numbers`: numbers read from flags and specs;
- `vllm_engine`: the same drafts measured in vLLM per k and batch size, the k-per-batch-size table;
  `vllm_worker`: its side in vLLM's own environment (run by path, imports nothing of ours);
  `crosscheck`: our per-position acceptance against vLLM's; `vllm_costs`: vLLM's own step costs and the
  speedup they predict for our acceptance; `vllm_cost_model`: a step-cost model fitted from runs without
  speculation (vLLM's, or our batched loop's), the prediction that does not use the speculative runs' timings.

The job (`jobs/spec_profile.py`) loads the models and calls `profile.profile`; the CLI prints.
"""
