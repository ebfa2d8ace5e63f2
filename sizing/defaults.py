"""Defaults of the kv-budget options, named once: the library dataclasses take them as
field defaults and the CLI's help text quotes them (this module imports nothing, so the
CLI can read it at start-up)."""

DEFAULT_GPU = "H100-80GB"
DEFAULT_MEM_UTIL = 0.9  # vLLM's --gpu-memory-utilization default
DEFAULT_BLOCK_SIZE = 16  # vLLM's default paged-attention block
# Activation peak + CUDA graphs + NCCL/cuBLAS workspaces kept aside per GPU. vLLM
# measures it by profiling; for Llama-3-8B on an H100 it logs ~1.3 GiB activation peak
# + ~1.8 GiB non-torch memory (vllm-project/vllm#10511), hence 3 GiB.
DEFAULT_RESERVE_BYTES = 3 * 2**30
DEFAULT_CONCURRENCY = (1, 8, 32, 128)
DEFAULT_OUTPUT_LEN = 256
DEFAULT_ACCOUNTING = "vllm"
VLLM_VERSION = "0.32.0"  # the vLLM release whose KV-cache accounting `vllm_kv` follows
