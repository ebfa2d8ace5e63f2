"""Defaults of the kv-budget options, named once: the library dataclasses take them as
field defaults and the CLI's help text quotes them (this module imports nothing, so the
CLI can read it at start-up)."""

DEFAULT_GPU = "H100-80GB"
# vLLM's --gpu-memory-utilization default before 0.21 (spec-profile's projection uses it;
# kv-budget takes the chosen release's own, `vllm_versions.VllmPolicy.default_mem_util`).
DEFAULT_MEM_UTIL = 0.9
DEFAULT_BLOCK_SIZE = 16  # vLLM's default paged-attention block
# A flat allowance for activations, CUDA graphs and workspaces per GPU, kept by
# spec-profile's projection; kv-budget models vLLM's profile instead (`vllm_memory`) and
# takes a flat figure only from --reserve.
DEFAULT_RESERVE_BYTES = 3 * 2**30
DEFAULT_CONCURRENCY = (1, 8, 32, 128)
DEFAULT_OUTPUT_LEN = 256
DEFAULT_ACCOUNTING = "vllm"
VLLM_VERSION = "0.32.0"  # the vLLM release whose KV-cache accounting `vllm_kv` follows
