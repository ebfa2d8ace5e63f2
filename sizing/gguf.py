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
    """Read the metadata header of a GGUF file. Every length the file claims is checked
    against the bytes left before anything is read or skipped, so a crafted header
    fails fast instead of allocating or looping."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            r = _Reader(f, os.fstat(f.fileno()).st_size)
            if r.read(4) != b"GGUF":
                raise BadInput(f"{p}: not a GGUF file (magic bytes are not 'GGUF')")
            version = r.unpack("<I")
            if version not in (2, 3):
                raise BadInput(f"{p}: GGUF version {version} not supported; accepted: 2, 3")
            tensor_count, kv_count = r.unpack("<Q"), r.unpack("<Q")
            r.claim(kv_count, _MIN_KV, "key/value pairs")
            metadata = {}
            for _ in range(kv_count):
                key = r.string()
                metadata[key] = r.value(r.unpack("<I"))
            return GgufHeader(version, tensor_count, metadata, f.tell(), r.size)
    except (OSError, struct.error, UnicodeDecodeError, ValueError) as e:
        raise BadInput(f"{p}: cannot read GGUF header ({e.__class__.__name__}: {e})") from None


_MIN_KV = 8 + 4 + 1  # empty key, value type, smallest value
_MIN_SIZE = {_STRING: 8, _ARRAY: 12}  # an empty string / array still has its header
_MAX_DEPTH = 4  # arrays of arrays nest at most this deep
_CHUNK = 1 << 20


class _Reader:
    """Reads within a file of `size` bytes; `claim` refuses counts the rest cannot hold."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f, self.size = f, size

    def left(self) -> int:
        return self.size - self.f.tell()

    def claim(self, count: int, each: int, what: str) -> None:
        if count * each > self.left():
            need = "" if each == 1 else f" ({count * each:,}+ bytes)"
            raise ValueError(f"header claims {count:,} {what}{need} but {self.left():,} bytes are left")

    def read(self, n: int) -> bytes:
        self.claim(n, 1, "bytes")
        return self.f.read(n)

    def skip(self, n: int) -> None:
        self.claim(n, 1, "bytes")
        self.f.seek(n, os.SEEK_CUR)

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.read(self.unpack("<Q")).decode("utf-8")

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype}")
        etype, n = self.unpack("<I"), self.unpack("<Q")
        if etype in _SCALARS:
            size = struct.calcsize(_SCALARS[etype])
            if n <= _KEEP_ARRAY:
                return [self.unpack(_SCALARS[etype]) for _ in range(n)]
            self.skip(n * size)  # one seek, after checking the bytes are there
        else:
            self.skip_array(etype, n, depth + 1)
        return GgufArray(etype, n)

    def skip_array(self, etype: int, n: int, depth: int) -> None:
        """Skip n values of a variable-size type (strings, arrays)."""
        if etype not in _MIN_SIZE:
            raise ValueError(f"unknown GGUF value type {etype}")
        if depth > _MAX_DEPTH:
            raise ValueError(f"arrays nested deeper than {_MAX_DEPTH}")
        self.claim(n, _MIN_SIZE[etype], "array values")  # bounds the walk by the file size
        if etype == _STRING:
            self._skip_strings(n)
            return
        for _ in range(n):
            inner, m = self.unpack("<I"), self.unpack("<Q")
            if inner in _SCALARS:
                self.skip(m * struct.calcsize(_SCALARS[inner]))
            else:
                self.skip_array(inner, m, depth + 1)

    def _skip_strings(self, n: int) -> None:
        """Walk n length-prefixed strings through 1 MiB buffers (a vocabulary holds
        ~10^5 of them; one read call each would dominate the start-up)."""
        buf, pos, start = b"", 0, self.f.tell()
        for _ in range(n):
            if pos + 8 > len(buf):
                buf, pos, start = self._refill(buf, pos, start)
            length = int.from_bytes(buf[pos : pos + 8], "little")
            pos += 8
            if start + pos + length > self.size:
                raise ValueError(f"a string claims {length:,} bytes but {self.size - start - pos:,} are left")
            if pos + length > len(buf):  # jump over a long string without buffering it
                start, buf, pos = start + pos + length, b"", 0
                self.f.seek(start)
            else:
                pos += length
        self.f.seek(start + pos)

    def _refill(self, buf: bytes, pos: int, start: int) -> tuple[bytes, int, int]:
        start += pos
        self.f.seek(start)
        buf = self.f.read(_CHUNK)
        if len(buf) < 8:
            raise ValueError("file ends inside an array of strings")
        return buf, 0, start


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
