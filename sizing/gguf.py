"""GGUF metadata header reader (standard library `struct` only) and the mapping of its
`<arch>.*` keys onto Hugging Face config names.

Reads the magic, version, tensor count and the key/value metadata; it never reads
tensor infos or tensor data. Large arrays (tokenizer vocabularies, merges) are skipped
over and kept as their length only. Layout (little-endian), per the GGUF spec in
ggml's docs/gguf.md: "GGUF", u32 version, u64 tensor_count, u64 kv_count, then
kv_count x (string key, u32 value_type, value); strings are u64 length + UTF-8 bytes.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from infer_tool.common.errors import BadInput

# value_type -> struct format of a scalar (8 = string, 9 = array are handled apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_KEEP_ARRAY = 1024  # numeric arrays up to this length are kept (per-layer head counts)


@dataclass(frozen=True)
class GgufArray:
    """An array left unread: its element type and length."""

    value_type: int
    length: int


@dataclass(frozen=True)
class GgufHeader:
    version: int
    tensor_count: int
    metadata: dict[str, Any]
    metadata_end: int  # byte offset where the tensor infos start
    file_size: int


def read_gguf_header(path: str | Path) -> GgufHeader:
    """Read the metadata header of a GGUF file."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise BadInput(f"{p}: not a GGUF file (magic bytes are not 'GGUF')")
            version = _unpack(f, "<I")
            if version not in (2, 3):
                raise BadInput(f"{p}: GGUF version {version} not supported; accepted: 2, 3")
            tensor_count, kv_count = _unpack(f, "<Q"), _unpack(f, "<Q")
            metadata = {}
            for _ in range(kv_count):
                key = _string(f)
                metadata[key] = _value(f, _unpack(f, "<I"))
            return GgufHeader(version, tensor_count, metadata, f.tell(), os.fstat(f.fileno()).st_size)
    except (OSError, struct.error, UnicodeDecodeError, ValueError) as e:
        raise BadInput(f"{p}: cannot read GGUF header ({e.__class__.__name__}: {e})") from None


def _unpack(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("file ends inside the metadata header")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    n = _unpack(f, "<Q")
    data = f.read(n)
    if len(data) != n:
        raise ValueError("file ends inside a string")
    return data.decode("utf-8")


def _value(f: BinaryIO, vtype: int) -> Any:
    if vtype in _SCALARS:
        return _unpack(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        etype, n = _unpack(f, "<I"), _unpack(f, "<Q")
        if etype in _SCALARS and n <= _KEEP_ARRAY:
            return [_unpack(f, _SCALARS[etype]) for _ in range(n)]
        if etype in _SCALARS:
            f.seek(n * struct.calcsize(_SCALARS[etype]), os.SEEK_CUR)
        else:
            for _ in range(n):
                _skip(f, etype)
        return GgufArray(etype, n)
    raise ValueError(f"unknown GGUF value type {vtype}")


def _skip(f: BinaryIO, vtype: int) -> None:
    if vtype in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[vtype]), os.SEEK_CUR)
    elif vtype == _STRING:
        f.seek(_unpack(f, "<Q"), os.SEEK_CUR)
    elif vtype == _ARRAY:
        etype, n = _unpack(f, "<I"), _unpack(f, "<Q")
        for _ in range(n):
            _skip(f, etype)
    else:
        raise ValueError(f"unknown GGUF value type {vtype}")


# GGUF `general.architecture` -> transformers model_type, where they differ.
_MODEL_TYPES = {"gemma3": "gemma3_text", "deepseek2": "deepseek_v2", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# `<arch>.<suffix>` -> config.json key.
_KEYS = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "attention.kv_lora_rank": "kv_lora_rank",
    "attention.q_lora_rank": "q_lora_rank",
    "rope.dimension_count": "qk_rope_head_dim",
    "expert_count": "num_local_experts",
    "expert_feed_forward_length": "moe_intermediate_size",
}


def config_from_gguf(header: GgufHeader) -> dict[str, Any]:
    """An HF-style config dict from GGUF metadata (for `hf_config.shape_from_config`)."""
    md = header.metadata
    arch = md.get("general.architecture")
    if not isinstance(arch, str):
        raise BadInput("GGUF metadata has no 'general.architecture'")
    cfg: dict[str, Any] = {"model_type": _MODEL_TYPES.get(arch, arch)}
    for suffix, key in _KEYS.items():
        v = md.get(f"{arch}.{suffix}")
        if isinstance(v, list):  # per-layer values (e.g. head counts): all equal or we refuse
            if len(set(v)) != 1:
                raise BadInput(f"GGUF key '{arch}.{suffix}' varies per layer; not supported")
            v = v[0]
        if v is not None:
            cfg[key] = v
    if "kv_lora_rank" in cfg:
        cfg.pop("head_dim", None)  # MLA key_length is the decompressed q/k head, not a cache size
    else:
        cfg.pop("qk_rope_head_dim", None)  # only MLA caches the rope part apart
    if "vocab_size" not in cfg:
        tokens = md.get("tokenizer.ggml.tokens")
        if isinstance(tokens, GgufArray):
            cfg["vocab_size"] = tokens.length
        elif isinstance(tokens, list):
            cfg["vocab_size"] = len(tokens)
    return cfg
