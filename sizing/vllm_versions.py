"""The vLLM releases whose KV-cache and memory-profile policies this package models, and
what differs between them. `--vllm-version X.Y` (or X.Y.Z) picks one; the default is the
release whose source `vllm_kv` and `vllm_memory` were read from (`defaults.VLLM_VERSION`).

Each policy names the release that introduced it, from the code or pull request that
changed it (0.32.0's own source for the present behaviour):
- `nccl_in_budget` (before 0.11): the worker took its init memory snapshot before the
  distributed environment came up, so NCCL's buffers counted against
  --gpu-memory-utilization; vllm-project/vllm#25359 moved the snapshot after NCCL init.
- `async_scheduling` default on since 0.14: two batches in flight (`config/vllm.py`
  `max_concurrent_batches`).
- `sampler_sort` (before 0.17): the profile's sampler pass sorted the logits
  (`apply_top_k_top_p_pytorch`); vllm-project/vllm#33538 replaced the sort with Triton
  top-k/top-p kernels working in place.
- `cudagraph_in_budget` since 0.21: the CUDA-graph memory estimate is subtracted from the
  KV cache (`VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS` defaults to 1, "default since
  v0.21.0" in 0.32's gpu_worker.py); before, graphs were captured after the KV cache was
  sized, out of the memory --gpu-memory-utilization leaves free.
- `default_mem_util` 0.92 since 0.21 (0.32's `CacheConfig`; 0.9 before). The release that
  changed it is not pinned by a source we found; 0.21 is assumed, with the CUDA-graph
  subtraction it offsets.
- `sliding_in_flight_batches` since 0.26: a sliding-window request reserves
  `max_in_flight_tokens` (batches x max_num_batched_tokens); before, one batch.
- `kv_tokens_per_concurrency` since 0.20: "GPU KV cache size" is `int(max_concurrency x
  max_model_len)` (`get_kv_cache_capacity`); before, `num_blocks // groups x min block
  size`, which differs for hybrid models (vllm-project/vllm#40691 reports 0.19.0's line;
  0.24.0 logs show the new one).
- `persistent_buffers_counted` since 0.27: the profile charges what the process holds
  after it (free-memory drop since the init snapshot, `total_consumed`) plus the transient
  torch peak (`utils/mem_utils.py` `memory_profiling`: "total_consumed already covers
  persistent torch allocations", present in the 0.27.0 and later wheels). Before, it
  charged the weights, the torch peak increase and the non-torch increase (0.26.0's
  `memory_profiling` and its log line, which names weights, peak and non-torch apart),
  so torch tensors a runner allocates between loading the weights and the profile run
  were outside the budget (the change is described in vllm-project/vllm#37111;
  ovg-project/kvcached#492 reports 0.28 reading `total_consumed`).
- `v2_cudagraph_estimate` since 0.29: Model Runner V2 estimates its CUDA graphs during
  the profile (`v1/worker/gpu/cudagraph_utils.py` `profile_cudagraph_memory`, called by
  `GPUModelRunner.profile_cudagraph_memory`). In 0.21-0.28 V2's
  `profile_cudagraph_memory` returns 0 ("It is TBD whether we keep this API or not", the
  0.26.0, 0.27.0 and 0.28.0 wheels), so the worker subtracts nothing and V2 captures its
  graphs after the KV cache is sized, out of the memory --gpu-memory-utilization leaves
  free, as V1 did before 0.21.
- `model_runner_v2(...)`: which model runner the worker builds when
  VLLM_USE_V2_MODEL_RUNNER is unset (0.32's `VllmConfig.use_v2_model_runner`). From the
  release notes: 0.22 Qwen3 dense models (vllm-project/vllm#39337), 0.23 also Llama and
  Mistral (#43458), 0.25 every dense model (#44443), 0.29 every model family (#53183,
  "the first tagged release with this default will be v0.29.0"). In 0.25-0.28 a dense
  model is one that is neither MoE nor hybrid nor attention-free, and the MoE families of
  `V2_MOE_MODEL_TYPES` (#42667, #45461) also default to V2
  (`_is_default_v2_model_runner_model`); those MoE families are assumed to join in 0.24,
  the release after they merged. Quantized checkpoints joined in 0.24 (#44446); before,
  a quantized Qwen3 / Llama / Mistral stayed on V1, which is not told apart here.
  Configurations the runner does not support still fall back to V1 (speculative methods,
  KV connectors, ...): `--model-runner` overrides. The release notes are quoted in
  LocalAI#10811 (0.25.0), IntelLabs/DeepMath#22 (0.23.0) and microsoft/byol#18 (0.22.0).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from infer_tool.common.errors import BadInput
from infer_tool.sizing.defaults import VLLM_VERSION

OLDEST = 10  # 0.10: the first V1-only release modelled
NEWEST = 32
V2_DENSE_MODEL_TYPES = {22: frozenset({"qwen3"}), 23: frozenset({"qwen3", "llama", "mistral"})}
V2_MOE_MODEL_TYPES = frozenset({"qwen2_moe", "deepseek_v2", "granitemoe"})


@dataclass(frozen=True)
class VllmPolicy:
    """What one vLLM minor release does differently (see the module docstring)."""

    version: str  # as given, less a leading "v": "0.21", "0.32.0"
    minor: int

    @property
    def nccl_in_budget(self) -> bool:
        return self.minor < 11

    @property
    def async_scheduling(self) -> bool:
        return self.minor >= 14

    @property
    def sampler_sort(self) -> bool:
        return self.minor < 17

    @property
    def kv_tokens_per_concurrency(self) -> bool:
        return self.minor >= 20

    @property
    def cudagraph_in_budget(self) -> bool:
        return self.minor >= 21

    @property
    def default_mem_util(self) -> float:
        return 0.92 if self.minor >= 21 else 0.9

    @property
    def sliding_in_flight_batches(self) -> bool:
        return self.minor >= 26

    @property
    def persistent_buffers_counted(self) -> bool:
        return self.minor >= 27

    @property
    def v2_cudagraph_estimate(self) -> bool:
        return self.minor >= 29

    def model_runner_v2(self, model_type: str, *, moe: bool, hybrid: bool, attention_free: bool) -> bool:
        """The runner this release picks for a model of `model_type` by default."""
        if self.minor >= 29:
            return True
        if self.minor >= 25:
            return not attention_free and (model_type in V2_MOE_MODEL_TYPES or not (moe or hybrid))
        if self.minor == 24:
            return model_type in V2_DENSE_MODEL_TYPES[23] or model_type in V2_MOE_MODEL_TYPES
        return model_type in V2_DENSE_MODEL_TYPES.get(self.minor, frozenset())


def modelled() -> str:
    return f"0.{OLDEST} to 0.{NEWEST} (X.Y or X.Y.Z)"


def policy(version: str = VLLM_VERSION) -> VllmPolicy:
    """The policies of vLLM `version` ("0.21", "0.21.1", "v0.32.0"); BadInput otherwise."""
    m = re.fullmatch(r"\s*v?0\.(\d+)(?:\.\d+)?(?:\.post\d+)?\s*", version)
    if not m or not OLDEST <= int(m.group(1)) <= NEWEST:
        raise BadInput(f"--vllm-version {version!r} is not modelled; accepted: {modelled()}")
    return VllmPolicy(version.strip().lstrip("v"), int(m.group(1)))
