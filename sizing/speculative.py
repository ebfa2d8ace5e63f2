"""`--speculative-config JSON` as `vllm serve` takes it, and the memory it adds: the
drafter's weights, the KV cache of its attention layers, and the lookahead slots each
request reserves. Read from vLLM 0.32.0's source:

- `config/vllm.py` `num_lookahead_tokens`: EAGLE-family methods (eagle, eagle3, mtp) and
  draft models reserve `num_speculative_tokens` KV slots past the scheduled tokens (DFlash
  one more); n-gram, suffix and Medusa none. `v1/core/kv_cache_manager.py` `allocate_slots`
  caps the slots at `max_model_len`, so at a context of `--max-model-len` they add no block;
  a shorter sequence holds `cdiv(min(len + k, max_model_len), block)` blocks.
- The drafter's attention layers register in the same static forward context as the
  target's, so `get_kv_cache_spec` gives them KV pages in the same block tables
  (`v1/core/kv_cache_utils.py`: "MTP drafters register their KV layers after the target
  layers"): a draft model's layers, an EAGLE head's layers (its config's
  `num_hidden_layers`, usually 1), or the target's own MTP layers
  (`num_nextn_predict_layers`, `mtp_num_hidden_layers`), each with the attention shape of
  the config it comes from.
- The drafter's weights load in the same worker, after the target's, so "Model loading
  took" holds both; `draft_tensor_parallel_size` splits them.
- `config/vllm.py` `uniform_decode_query_len` = 1 + k: the default CUDA-graph ceiling
  becomes `min(max_num_seqs x (1 + k) x 2, 512)` and the FULL decode graphs are captured at
  request counts x (1 + k) tokens (`_set_cudagraph_sizes`).
Not modelled: the drafter's own activations in the profile run (it runs after the target's
forward, on the same tokens; a note says so).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from infer_tool.common.errors import BadInput

EAGLE_METHODS = ("eagle", "eagle3", "mtp")
DRAFT_METHODS = ("draft_model",)
NO_KV_METHODS = ("ngram", "suffix", "medusa", "ngram_gpu")
METHODS = (*DRAFT_METHODS, *EAGLE_METHODS, *NO_KV_METHODS)
_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "draft_tensor_parallel_size",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "quantization",
    "max_model_len",
    "revision",
    "draft_model",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft model or EAGLE head (a directory, config.json or preset)
    draft_tensor_parallel_size: int | None = None  # None: the target's TP

    @property
    def lookahead_tokens(self) -> int:
        """KV slots each request reserves past its scheduled tokens (vLLM 0.32)."""
        return self.num_speculative_tokens if self.method in (*EAGLE_METHODS, *DRAFT_METHODS) else 0

    @property
    def decode_query_len(self) -> int:
        return 1 + self.num_speculative_tokens


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """`--speculative-config` JSON -> SpeculativeConfig; BadInput naming what is wrong."""
    flag = "--speculative-config"
    if len(text) > 10_000:
        raise BadInput(f"{flag}: {len(text):,} characters; a speculative config is a short JSON object")
    try:
        raw: Any = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise BadInput(
            f"{flag} {text[:60]!r} is not JSON ({e}); e.g. "
            '\'{"method": "eagle3", "model": "DIR", "num_speculative_tokens": 3}\''
        ) from None
    if not isinstance(raw, dict):
        raise BadInput(f"{flag} {text[:60]!r} must be a JSON object")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise BadInput(f"{flag}: keys {unknown} are not read here; accepted: {', '.join(sorted(_KEYS))}")
    model = raw.get("model") or raw.get("draft_model")
    if model is not None and not isinstance(model, str):
        raise BadInput(f"{flag}: model {model!r} must be a string (a directory, config.json or preset)")
    method = raw.get("method")
    if method is None:  # vLLM: a model without a method is a draft model ("[ngram]" for the n-gram names)
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
        model = None if method == "ngram" else model
    if method not in METHODS:
        raise BadInput(f"{flag}: method {method!r} is not modelled; accepted: {', '.join(METHODS)}")
    k = raw.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64:
        raise BadInput(f"{flag}: num_speculative_tokens {k!r} must be an integer from 1 to 64")
    dtp = raw.get("draft_tensor_parallel_size")
    if dtp is not None and (isinstance(dtp, bool) or not isinstance(dtp, int) or not 1 <= dtp <= 1024):
        raise BadInput(f"{flag}: draft_tensor_parallel_size {dtp!r} must be an integer from 1")
    if method in (*DRAFT_METHODS, "eagle", "eagle3") and model is None:
        raise BadInput(f'{flag}: method {method!r} needs "model" (the draft\'s directory, config.json or preset)')
    return SpeculativeConfig(method, k, model, dtp)
