"""Read fields of a Hugging Face `config.json` as they really come: multimodal wrappers
nest the language model under `text_config`; older families use other key names
(GPT-2 `n_layer`/`n_head`/`n_embd`); some configs omit fields whose value is the
config class's default. A needed field that is absent is named in the error.

This module knows key names and per-family defaults, not what the numbers mean.
"""

from __future__ import annotations

from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.sizing.class_defaults import class_defaults

_MISSING = object()

# The largest value a real model's config holds for a field, with room to spare (the
# largest public models: ~200 layers, 128 heads, hidden 2^15, vocab 2^18, 10M positions).
# A larger number is a typo or a hostile file: refused, never sized.
FIELD_MAXIMUM: dict[str, int] = {
    "num_hidden_layers": 4096,
    "num_attention_heads": 2**16,
    "num_key_value_heads": 2**16,
    "head_dim": 2**16,
    "hidden_size": 2**20,
    "intermediate_size": 2**22,
    "moe_intermediate_size": 2**22,
    "vocab_size": 2**26,
    "max_position_embeddings": 2**30,
    "sliding_window": 2**30,
    "n_routed_experts": 2**16,
    "num_experts_per_tok": 2**16,
}
DEFAULT_MAXIMUM = 2**31 - 1  # any other integer field

# Facts of a family that its transformers config class does not hold as a field (Qwen2's
# q/k/v biases, Gemma 3's every-sixth-layer-global pattern, Qwen3-Next's attention
# interval), used after the class's own defaults (`class_defaults`). Only keys that change
# a size are listed.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False, "attention_bias": False},
    "mistral": {"tie_word_embeddings": False},
    "mixtral": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": False, "attention_bias": True},
    "qwen2_moe": {"tie_word_embeddings": False, "attention_bias": True},
    "qwen3": {"tie_word_embeddings": False},
    "qwen3_moe": {"tie_word_embeddings": False},
    "qwen3_next": {"tie_word_embeddings": False, "full_attention_interval": 4},
    "qwen3_5_text": {"tie_word_embeddings": False, "full_attention_interval": 4},
    "gpt_oss": {"tie_word_embeddings": False, "attention_bias": True},
    "gemma": {"tie_word_embeddings": True, "head_dim": 256},
    "gemma2": {"tie_word_embeddings": True, "head_dim": 256, "sliding_window": 4096},
    "gemma3_text": {
        "tie_word_embeddings": True,
        "head_dim": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
    },
    "deepseek_v2": {"tie_word_embeddings": False},
    "deepseek_v3": {"tie_word_embeddings": False},
    "jamba": {"tie_word_embeddings": False},
    "gpt2": {"tie_word_embeddings": True, "n_positions": 1024, "attention_bias": True},
}

# Families whose layer layout and parameter count this package knows (the rest are
# sized as plain attention from their fields, with a note saying so).
KNOWN_MODEL_TYPES = frozenset(FAMILY_DEFAULTS) | {
    "gemma3",
    "gpt_neox",
    "gpt_bigcode",
    "opt",
    "bloom",
    "falcon",
    "phi",
    "phi3",
    "starcoder2",
}


class MissingField(BadInput):
    """A field the config lacks and nothing defaults (a present but invalid value is a
    plain BadInput): callers may leave the term it sizes unknown."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class ConfigView:
    """A config dict with the language model's fields on top (`text_config` merged over
    the wrapper's) and family defaults underneath."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        if not isinstance(raw, dict):
            raise BadInput(f"{source}: config is not a JSON object")
        self.source = source
        self.nested = isinstance(raw.get("text_config"), dict)
        merged = dict(raw)
        if self.nested:
            merged.update(raw["text_config"])
        self.model_type: str = str(merged.get("model_type") or "")
        if self.nested and raw["text_config"].get("model_type") is None:
            # Gemma 3 wrappers may leave the text model's type implicit.
            self.model_type = {"gemma3": "gemma3_text"}.get(self.model_type, self.model_type)
        self._raw = merged
        self._defaults = FAMILY_DEFAULTS.get(self.model_type, {})
        self.class_name, self._class = class_defaults(self.model_type)
        self.defaulted: dict[str, Any] = {}  # field -> class default used
        self.unknown: dict[str, str] = {}  # term -> the field nothing defaulted

    def has(self, *keys: str) -> bool:
        return self.get(*keys, default=None) is not None

    def get(self, *keys: str, default: Any = _MISSING) -> Any:
        """First of `keys` the config gives a value, else the model's config class default
        (`class_defaults`), else the family fact (`FAMILY_DEFAULTS`), else `default`;
        raises MissingField naming `keys[0]` when nothing is found. A key the config sets
        to null takes no default from the class (transformers keeps the null)."""
        for k in keys:
            v = self._raw.get(k)
            if v is not None:
                return v
        if any(k in self._raw for k in keys):  # explicitly null
            return self._absent(keys, default)
        for k in keys:
            if self._class.get(k) is not None:
                self.defaulted.setdefault(k, self._class[k])
                return self._class[k]
        for k in keys:
            if self._defaults.get(k) is not None:
                return self._defaults[k]
        return self._absent(keys, default)

    def _absent(self, keys: tuple[str, ...], default: Any) -> Any:
        if default is _MISSING:
            also = f" (or {', '.join(keys[1:])})" if len(keys) > 1 else ""
            raise MissingField(
                f"{self.source}: config is missing '{keys[0]}'{also}, needed to size "
                f"model_type '{self.model_type or 'unknown'}'",
                keys[0],
            )
        return default

    def defaults_note(self) -> str | None:
        """Which missing fields took the config class's defaults (None if none did)."""
        if not self.defaulted:
            return None
        fields = ", ".join(f"{k} {v!r}" for k, v in sorted(self.defaulted.items()))
        return f"config.json omits fields; took {self.class_name}'s defaults: {fields}"

    def int(self, *keys: str, default: Any = _MISSING, minimum: int = 1) -> int:
        """An integer field in [minimum, the field's maximum]; BadInput names the field and value."""
        v = self.get(*keys, default=default)
        check_int(v, self.source, self._present(keys), minimum)
        return v

    def optional_int(self, *keys: str, minimum: int = 1) -> int | None:
        """As `int`, or None when no key (nor default) gives a value."""
        v = self.get(*keys, default=None)
        if v is None:
            return None
        check_int(v, self.source, self._present(keys), minimum)
        return v

    def _present(self, keys: tuple[str, ...]) -> str:
        """The key a value came from (the first given, else the first name)."""
        return next((k for k in keys if self._raw.get(k) is not None), keys[0])


def check_int(v: Any, source: str, field: str, minimum: int = 1) -> None:
    """Raise BadInput unless `v` is an integer within [minimum, the field's maximum]."""
    top = FIELD_MAXIMUM.get(field, DEFAULT_MAXIMUM)
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= top:
        shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
        raise BadInput(f"{source}: config field '{field}' = {shown}; expected an integer from {minimum:,} to {top:,}")
