"""Batch-1 forward passes of a causal LM with a rollback-able KV cache.

The one place that knows how `transformers` names and builds the cache: 5.x calls the
forward argument `cache` (4.x `past_key_values`), `DynamicCache(config=...)` exists since
4.56, and `DynamicCache.crop(-n)` removes the last n positions in both. Nothing here knows
about drafts, acceptance or sampling.
"""

from __future__ import annotations

import inspect

import torch

from infer_tool.common.errors import BadInput


class NonFiniteLogits(BadInput):
    """A model's logits hold NaN or +inf, or a row with no finite entry: its outputs cannot
    be compared (argmax and softmax of NaN give made-up tokens and acceptance)."""


def check_finite(logits: torch.Tensor, name: str, first_position: int) -> torch.Tensor:
    """`logits` (n, V) unchanged, or NonFiniteLogits naming the model and the first bad
    sequence position (row i is at `first_position + i`). -inf entries are allowed (masked
    tokens) as long as each row has a finite maximum."""
    bad = torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1) | ~torch.isfinite(logits.amax(-1))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise NonFiniteLogits(f"{name} gave non-finite logits (NaN or inf) at sequence position {first_position + row}")
    return logits


def _cache_kwarg(model: torch.nn.Module) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class CachedLM:
    """A causal LM decoding one sequence (batch 1) with a KV cache that can roll back.

    `vocab` is the number of logit columns kept (the tokenizer vocabulary shared with the
    other model; padded rows of a larger embedding are dropped).
    """

    def __init__(self, model: torch.nn.Module, vocab: int | None = None, name: str = "the model"):
        self.model = model
        self.name = name
        self.vocab = vocab
        self._kwarg = _cache_kwarg(model)
        self.cache = None
        self.cached_len = 0

    def reset(self) -> None:
        from transformers import DynamicCache

        try:
            self.cache = DynamicCache(config=self.model.config)
        except TypeError:  # transformers < 4.56
            self.cache = DynamicCache()
        self.cached_len = 0

    @torch.inference_mode()
    def extend(self, seq: torch.Tensor) -> torch.Tensor:
        """Feed the tokens of `seq` (L,) not yet in the cache; logits (n_new, V) float32
        at those positions (row i predicts token cached_len + i + 1)."""
        if self.cache is None:
            self.reset()
        new = seq[self.cached_len :]
        assert new.numel() > 0, "nothing to feed: the cache already holds the whole sequence"
        out = self.model(input_ids=new[None], use_cache=True, **{self._kwarg: self.cache})
        first = self.cached_len
        self.cached_len = seq.shape[0]
        return check_finite(out.logits[0, :, : self.vocab].float(), self.name, first)

    def rollback(self, length: int) -> None:
        """Keep only the first `length` positions in the cache."""
        remove = self.cached_len - length
        if remove > 0:
            self.cache.crop(-remove)
            self.cached_len = length

    @torch.inference_mode()
    def score(self, seq: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits for the whole sequence in one pass, no cache: (L, V)."""
        out = self.model(input_ids=seq[None], use_cache=False)
        return check_finite(out.logits[0, :, : self.vocab].float(), self.name, 0)


def vocab_size(model: torch.nn.Module) -> int:
    """Number of logit columns of a causal LM."""
    head = model.get_output_embeddings()
    out_features = getattr(head, "out_features", None)
    return int(out_features if out_features is not None else model.config.vocab_size)
