"""Draft proposers for speculative decoding.

Three kinds share one small interface (`start`, `prefill`, `propose`, `rollback`,
`teacher_forced`, `round_acceptance`, `round_drafted`):
- `ModelDraft`: any causal LM over the target's vocabulary (a smaller HF model, an INT4
  copy of the target loaded by `evals.load_model`, or `truncated_copy` of the target),
  sampling its k tokens one at a time from its own KV cache;
- `NgramDraft`: model-free prompt lookup. It finds the most recent (or, as vLLM does, the
  earliest) earlier occurrence of the last n tokens (n from `max_ngram` down to 1) in the
  sequence so far and proposes the tokens that followed it. Its q is a one-hot on each
  proposal (a deterministic draft), so the acceptance step accepts with probability p(x);
  when nothing matches it proposes nothing and the target takes a plain step;
- `SuffixDraft`: suffix decoding (Oliaro et al. 2024), proposals from `arctic-inference`'s
  suffix tree over the sequence so far (the package vLLM 0.32 runs for `method: suffix`,
  called with vLLM's arguments); a lookup draft like prompt lookup, its proposals as long as
  the tree's confidence allows (up to k).

What this module does not know: how tokens are verified (`sampling`) or timed
(`decode`), or where models come from (`jobs/spec_profile.py` resolves specs).
"""

from __future__ import annotations

import copy

import torch

from infer_tool.common.errors import BadInput
from infer_tool.spec.cached_lm import CachedLM
from infer_tool.spec.sampling import sample, warp

NGRAM_DEFAULT = 3


class ModelDraft:
    """A causal-LM draft. `model` must share the target's token ids below `vocab`."""

    def __init__(self, name: str, model: torch.nn.Module, vocab: int):
        self.name = name
        self.lm = CachedLM(model, vocab, name=f"draft {name}")
        self.vocab = vocab

    def restrict_vocab(self, vocab: int) -> None:
        """Use only the first `vocab` logit columns (the vocabulary shared by all models)."""
        self.vocab = self.lm.vocab = vocab

    def start(self) -> None:
        self.lm.reset()

    def prefill(self, seq: torch.Tensor) -> None:
        """Start over with `seq` (L,) in the cache (the prompt, fed before decoding starts)."""
        self.start()
        self.lm.extend(seq)

    def propose(
        self, seq: torch.Tensor, k: int, temperature: float, top_p: float, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft k tokens after `seq` (L,): returns tokens (k,) and their q rows (k, V)."""
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        ctx = seq
        for _ in range(k):
            logits = self.lm.extend(ctx)[-1]  # (V,)
            q = warp(logits, temperature, top_p)
            x = int(q.argmax()) if temperature == 0 else sample(q, generator)
            tokens.append(x)
            qs.append(q)
            ctx = torch.cat([ctx, ctx.new_tensor([x])])
        return seq.new_tensor(tokens), torch.stack(qs)

    def rollback(self, length: int) -> None:
        """Forget everything after the first `length` tokens of the sequence."""
        self.lm.rollback(min(self.lm.cached_len, length))

    def teacher_forced(self, seq: torch.Tensor, start: int, temperature: float, top_p: float) -> torch.Tensor:
        """q rows (L - start, V) predicting seq[start:], from one forward pass over seq."""
        return warp(self.lm.score(seq)[start - 1 : -1], temperature, top_p)

    def round_acceptance(
        self, seq: torch.Tensor, start: int, k: int, p: torch.Tensor, beta: torch.Tensor
    ) -> list[list[float]]:
        """Per continuation position t (seq[start + t] the next token): the acceptance
        probabilities of the k tokens a round starting there drafts, along the target's
        continuation: β[t : t + k] (exact at temperature 0, where an accepted draft token
        is the continuation's token)."""
        b = beta.tolist()
        return [b[t : t + k] for t in range(len(b))]

    def round_drafted(self, seq: torch.Tensor, start: int, k: int) -> list[int]:
        """Tokens a round starting at each continuation position drafts when it is not cut at
        the sequence's end (vLLM's rule): always k."""
        return [k] * (seq.shape[0] - start)


class NgramDraft:
    """Prompt lookup: propose the continuation of the latest earlier match of the last
    n tokens, n = max_ngram .. 1."""

    def __init__(self, vocab: int, max_ngram: int = NGRAM_DEFAULT, name: str | None = None, earliest: bool = False):
        if max_ngram < 1:
            raise BadInput(f"prompt-lookup n-gram size must be >= 1 (got {max_ngram})")
        self.name = name or f"prompt-lookup:{max_ngram}"
        self.vocab = vocab
        self.max_ngram = max_ngram
        self.earliest = earliest  # vLLM's rule: the earliest occurrence of the longest match

    def restrict_vocab(self, vocab: int) -> None:
        self.vocab = vocab

    def clone(self) -> NgramDraft:
        """A copy with state of its own (one per sequence of a batch)."""
        return copy.copy(self)

    def start(self) -> None:
        pass

    def prefill(self, seq: torch.Tensor) -> None:
        pass

    def rollback(self, length: int) -> None:
        pass

    def lookup(self, seq: list[int], k: int) -> list[int]:
        """Up to k proposed tokens following the latest (`earliest`: the earliest, as vLLM's
        `ngram_proposer.py`) earlier match of the longest matching suffix of seq."""
        L = len(seq)
        for n in range(min(self.max_ngram, L - 1), 0, -1):
            suffix = seq[L - n :]
            starts = range(L - n) if self.earliest else range(L - n - 1, -1, -1)
            for s in starts:  # matches ending before the suffix's last token
                if seq[s : s + n] == suffix:
                    return seq[s + n : s + n + k]
        return []

    def propose(
        self, seq: torch.Tensor, k: int, temperature: float, top_p: float, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.lookup(seq.tolist(), k)
        t = seq.new_tensor(tokens)
        return t, torch.nn.functional.one_hot(t, self.vocab).float()

    def teacher_forced(self, seq: torch.Tensor, start: int, temperature: float, top_p: float) -> torch.Tensor:
        """q rows (L - start, V): one-hot on the 1-token proposal from seq[:t], zero when
        there is none (so that position counts as a rejection)."""
        ids = seq.tolist()
        q = torch.zeros(len(ids) - start, self.vocab, device=seq.device)
        for t in range(start, len(ids)):
            prop = self.lookup(ids[:t], 1)
            if prop:
                q[t - start, prop[0]] = 1.0
        return q

    def round_acceptance(
        self, seq: torch.Tensor, start: int, k: int, p: torch.Tensor, beta: torch.Tensor
    ) -> list[list[float]]:
        """Per continuation position t: the target's probability p[t + i](x_i) of each
        token x_i of the up-to-k-token proposal a round starting there makes (one match's
        continuation, possibly shorter than k, empty when nothing matches). p: (T, V)
        target rows, row t predicting seq[start + t]."""
        ids = seq.tolist()
        out: list[list[float]] = []
        for t in range(len(ids) - start):
            prop = self.lookup(ids[: start + t], k)[: len(ids) - start - t]
            out.append([float(p[t + i, x]) for i, x in enumerate(prop)])
        return out

    def round_drafted(self, seq: torch.Tensor, start: int, k: int) -> list[int]:
        """Tokens a round starting at each continuation position proposes, not cut at the
        sequence's end (vLLM's rule)."""
        ids = seq.tolist()
        return [len(self.lookup(ids[: start + t], k)) for t in range(len(ids) - start)]


SUFFIX_PACKAGE = "arctic-inference==0.1.1"  # the version vLLM 0.32 asks for (config/speculative.py)
SUFFIX_DEFAULTS = {"max_tree_depth": 24, "max_spec_factor": 1.0, "min_token_prob": 0.1}  # vLLM 0.32's


def suffix_cache_class() -> type:
    """arctic-inference's `SuffixDecodingCache`, or a one-line BadInput saying how to install it."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        raise BadInput(
            f"draft suffix needs the {SUFFIX_PACKAGE} package (suffix decoding's suffix tree, as vLLM runs it), "
            f"not importable here ({type(e).__name__}: {e}); install it with: pip install {SUFFIX_PACKAGE} "
            "(a source build; docs/commands/spec-profile.md shows a 15-second one)"
        ) from None
    return SuffixDecodingCache


class SuffixDraft(NgramDraft):
    """Suffix decoding's proposals for the sequence so far, as vLLM's `SuffixDecodingProposer`
    makes them for one request: a suffix tree over the prompt and the tokens generated (no
    cache of other requests' outputs), matched against the last `max_tree_depth` tokens, up
    to k tokens limited by `max_spec_factor` x the match length and by `min_token_prob`. The
    tree grows as the sequence does and is rebuilt when the sequence is not an extension of
    what it holds."""

    REQUEST = "seq"

    def __init__(
        self,
        vocab: int,
        name: str = "suffix",
        max_tree_depth: int = 24,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ):
        super().__init__(vocab, 1, name=name)
        self.cache_class = suffix_cache_class()
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.cache = None
        self.held: list[int] = []

    def clone(self) -> SuffixDraft:
        other = copy.copy(self)
        other.cache, other.held = None, []
        return other

    def _sync(self, seq: list[int]) -> None:
        """Make the tree hold exactly `seq`: extend it, or rebuild it when seq diverges."""
        import numpy as np

        if self.cache is None or seq[: len(self.held)] != self.held:
            self.cache = self.cache_class(max_tree_depth=self.max_tree_depth, max_cached_requests=0)
            self.cache.start_request(self.REQUEST, np.asarray(seq, dtype=np.int32))
        elif len(seq) > len(self.held):
            self.cache.add_active_response(self.REQUEST, np.asarray(seq[len(self.held) :], dtype=np.int32))
        self.held = list(seq)

    def lookup(self, seq: list[int], k: int) -> list[int]:
        """Up to k tokens suffix decoding proposes after seq."""
        import numpy as np

        if not seq or k < 1:
            return []
        self._sync(seq)
        draft = self.cache.speculate(
            self.REQUEST,
            np.asarray(seq[-self.max_tree_depth :], dtype=np.int32),
            max_spec_tokens=k,
            max_spec_factor=self.max_spec_factor,
            min_token_prob=self.min_token_prob,
        )
        return list(draft.token_ids)[:k]


Draft = ModelDraft | NgramDraft


def _decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """The (parent module, attribute name) of the ModuleList holding the decoder layers:
    the ModuleList whose length is config.num_hidden_layers."""
    n = model.config.num_hidden_layers
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            parent_name, _, attr = name.rpartition(".")
            return model.get_submodule(parent_name) if parent_name else model, attr
    raise BadInput(f"cannot find the {n} decoder layers of {type(model).__name__} to truncate")


def truncated_copy(target: torch.nn.Module, n_layers: int) -> torch.nn.Module:
    """The target's first `n_layers` decoder layers followed by its final norm and LM head.

    Shares every weight with the target (shallow module copies, no tensor is copied);
    only the config (num_hidden_layers, per-layer lists) and the layer list are new.
    """
    total = target.config.num_hidden_layers
    if not 1 <= n_layers < total:
        raise BadInput(f"truncated:N needs 1 <= N < {total} (the target's layer count), got {n_layers}")
    parent, attr = _decoder_layers(target)
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = n_layers
    for key in ("layer_types", "sliding_window_pattern_list"):
        if isinstance(getattr(config, key, None), list):
            setattr(config, key, getattr(config, key)[:n_layers])

    def shallow(module: torch.nn.Module) -> torch.nn.Module:
        clone = copy.copy(module)
        clone._modules = dict(module._modules)
        clone._parameters = dict(module._parameters)
        clone._buffers = dict(module._buffers)
        for key, value in vars(module).items():  # hooks registered later stay separate
            if "hook" in key and isinstance(value, dict):
                setattr(clone, key, type(value)(value))
        if hasattr(clone, "config"):
            clone.config = config
        return clone

    # Copy the path from the root down to the layer list's parent, re-linking each level.
    path = [n for n in _module_path(target, parent)]
    root = shallow(target)
    node = root
    for name in path:
        child = shallow(node._modules[name])
        node._modules[name] = child
        node = child
    node._modules[attr] = torch.nn.ModuleList(list(getattr(parent, attr))[:n_layers])
    if getattr(target, "generation_config", None) is not None:
        root.generation_config = copy.deepcopy(target.generation_config)
    return root


def _module_path(root: torch.nn.Module, module: torch.nn.Module) -> list[str]:
    for name, m in root.named_modules():
        if m is module:
            return name.split(".") if name else []
    raise ValueError("module not found under root")
