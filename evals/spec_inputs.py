"""Turn `spec-profile`'s user specs into its inputs: prompts, drafts, a shared vocabulary.

- Prompts: from a corpus spec (`calib.corpora.load_text`). A local `.txt` file holds one
  prompt per non-empty line; any other corpus (`sotu:eval`, .jsonl records, ...) is split
  into paragraphs at blank lines. `num_prompts` are taken evenly spaced through the
  corpus, each cut to its first `prompt_len` tokens.
- Drafts: `truncated:N` (the target's first N layers with its head), `ngram` /
  `prompt-lookup[:N]` (prompt lookup matching up to N-grams), or a model spec (a model
  directory, .gguf, demo name or one of this tool's quantized checkpoints).
- Vocabulary: a model draft must map every token string to the same id as the target.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import torch

from infer_tool.common.errors import BadInput
from infer_tool.evals.spec_drafts import NGRAM_DEFAULT, Draft, ModelDraft, NgramDraft, truncated_copy
from infer_tool.evals.spec_models import vocab_size

NGRAM_NAMES = ("ngram", "prompt-lookup")


def split_prompts(text: str, one_per_line: bool) -> list[str]:
    parts = text.splitlines() if one_per_line else re.split(r"\n\s*\n", text)
    return [p.strip() for p in parts if p.strip()]


def load_prompts(
    spec: str, tokenizer: Any, num_prompts: int, prompt_len: int, text_field: str = "text"
) -> list[torch.Tensor]:
    """`num_prompts` prompts (each (P_i,) int64, 1 <= P_i <= prompt_len) from a corpus spec."""
    from infer_tool.calib.corpora import load_text, tokenize

    if num_prompts < 1 or prompt_len < 1:
        raise BadInput(f"--num-prompts and --prompt-len must be >= 1 (got {num_prompts}, {prompt_len})")
    texts = split_prompts(load_text(spec, text_field), Path(spec).suffix.lower() == ".txt")
    if not texts:
        raise BadInput(f"no non-empty prompts in {spec!r}")
    picks = sorted({int(i * len(texts) / num_prompts) for i in range(num_prompts)})
    prompts = [tokenize(texts[i], tokenizer)[:prompt_len] for i in picks]
    prompts = [p for p in prompts if p.numel() > 0]
    if not prompts:
        raise BadInput(f"the prompts in {spec!r} tokenize to nothing")
    return prompts


def shared_vocab(target_model: Any, target_tok: Any, draft_model: Any, draft_tok: Any, draft_name: str) -> int:
    """Number of logit columns both models use; BadInput naming the difference when the
    tokenizers disagree on any token's id or a model cannot emit every token."""
    if target_tok is not None and draft_tok is not None:
        tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
        if tv != dv:
            only_t = sorted(set(tv) - set(dv))[:3]
            only_d = sorted(set(dv) - set(tv))[:3]
            moved = sorted(t for t in set(tv) & set(dv) if tv[t] != dv[t])[:3]
            detail = [f"{len(tv)} target tokens vs {len(dv)} draft tokens"]
            if only_t:
                detail.append(f"only in the target: {only_t}")
            if only_d:
                detail.append(f"only in the draft: {only_d}")
            if moved:
                detail.append("different ids: " + ", ".join(f"{t!r} {tv[t]} vs {dv[t]}" for t in moved))
            raise BadInput(f"draft {draft_name!r} does not share the target's vocabulary ({'; '.join(detail)})")
    needed = max(target_tok.get_vocab().values()) + 1 if target_tok is not None else 0
    vt, vd = vocab_size(target_model), vocab_size(draft_model)
    if target_tok is None and vt != vd:
        raise BadInput(f"draft {draft_name!r} has {vd} output tokens, the target {vt}")
    v = min(vt, vd)
    if v < needed:
        raise BadInput(f"draft {draft_name!r} emits {vd} token ids but the tokenizer needs {needed}")
    return v


def _ngram_size(spec: str) -> int | None:
    name, _, arg = spec.partition(":")
    if name not in NGRAM_NAMES:
        return None
    if not arg:
        return NGRAM_DEFAULT
    if not arg.isdigit() or int(arg) < 1:
        raise BadInput(f"bad draft {spec!r}: expected {name}:N with N >= 1 (the longest n-gram matched)")
    return int(arg)


def make_draft(
    spec: str, target_model: Any, target_tok: Any, load: Callable[[str], Any]
) -> tuple[Draft, int]:
    """A draft from its spec and the logit columns shared with the target.

    `load(spec) -> LoadedModel` loads a model draft (plain or quantized)."""
    target_vocab = vocab_size(target_model)
    n = _ngram_size(spec)
    if n is not None:
        return NgramDraft(target_vocab, n, name=spec if ":" in spec else f"{spec}:{n}"), target_vocab
    if spec.startswith("truncated:"):
        arg = spec.partition(":")[2]
        if not arg.isdigit():
            raise BadInput(f"bad draft {spec!r}: expected truncated:N with N the number of layers kept")
        return ModelDraft(spec, truncated_copy(target_model, int(arg)), target_vocab), target_vocab
    loaded = load(spec)
    v = shared_vocab(target_model, target_tok, loaded.model, loaded.tokenizer, spec)
    return ModelDraft(spec, loaded.model, v), v
