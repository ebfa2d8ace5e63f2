"""A checkpoint assembled from parts: safetensors files each holding some of its tensors
(`checkpoint_tensors(..., within=...)` of one decoder layer, or of everything outside the
layers), as a streamed quantize run writes them. The shards are written one tensor at a
time; the bytes are those `write_checkpoint` writes for the whole model in memory.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infer_tool.packers.checkpoint import (
    DEFAULT_SHARD_BYTES,
    assemble,
    check_checkpoint_out,
    checkpoint_config,
    get_format,
    ignored_linears,
)
from infer_tool.packers.safetensors_stream import spec_of
from infer_tool.packers.shards import PartFiles


def write_from_parts(
    parts: Sequence[Path],
    out_dir: str | os.PathLike[str],
    model: nn.Module,
    quantized: Mapping[str, Any],
    fmt: str,
    scheme: Any,
    *,
    dtype: torch.dtype,
    tmp: Path,
    src_dir: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    extra_files: Mapping[str, str | bytes] | None = None,
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    rename: Callable[[str], str] | None = None,
    unquantized: Sequence[str] = (),
) -> Path:
    """`write_checkpoint` from `parts` (see the module docstring): the shards are assembled
    in `tmp`, which is then renamed to `out_dir`. `model` gives the config (its weights may
    be on the meta device), `quantized` the quantized linears' names (their weights are not
    read). rename, unquantized: as for `write_checkpoint` (the parts hold the model's names)."""
    out = Path(out_dir)
    fmt_obj = get_format(fmt, scheme.kind)
    check_checkpoint_out(out, overwrite=overwrite, src_dir=src_dir)
    ignore = ignored_linears(model, quantized, unquantized, rename)
    source = PartFiles(parts)
    stored = {(rename or str)(s.name): s.name for s in source.specs()}
    extra = {k: t.detach().to("cpu").contiguous() for k, t in (extra_tensors or {}).items()}
    shutil.rmtree(tmp, ignore_errors=True)  # an earlier attempt's
    tmp.mkdir(parents=True)
    try:
        specs = [replace(s, name=n) for n, s in zip(stored, source.specs())] + [spec_of(n, t) for n, t in extra.items()]
        assemble(
            tmp,
            out,
            specs,
            lambda n: extra[n] if n in extra else source.load(stored[n]),
            model,
            checkpoint_config(model, fmt_obj, scheme, ignore, dtype),
            src_dir,
            extra_files,
            max_shard_bytes,
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
