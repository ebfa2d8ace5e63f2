"""compressed-tensors `mixed-precision` checkpoints: several config groups, one per scheme,
each naming its linears in `targets` and carrying its own `format` (llm-compressor writes a
recipe with several schemes so: top-level `"format": "mixed-precision"`; vLLM's
`get_scheme_dict` and compressed-tensors read each group's `format`).

Per linear the tensors are exactly those its scheme's own compressed-tensors codec writes
(`CheckpointFormat.tensors` of `get_format("compressed-tensors", scheme.kind)`); this module
only groups linears by scheme, merges the groups' configs and splits them again to read.
Group targets are the exact module names (reading also takes `re:` patterns, matched from
the start of the name as compressed-tensors and vLLM match them). Unquantized linears go to
`ignore`. What a group's scheme means, and how its tensors look, this module does not know.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infer_tool.common.errors import BadInput
from infer_tool.packers.checkpoint import (
    DEFAULT_SHARD_BYTES,
    CheckpointFormat,
    assemble,
    check_checkpoint_out,
    checkpoint_config,
    checkpoint_tensors,
    format_of,
    get_format,
    ignored_linears,
    model_dtype,
    staging,
)
from infer_tool.packers.shards import in_memory

FORMAT_NAME = "mixed-precision"
ExtraFiles = Mapping[str, str | bytes] | Callable[[Mapping[str, torch.Tensor]], Mapping[str, str | bytes]] | None
KIND = "mixed"
# every suffix a compressed-tensors codec writes for a linear (tests/test_mixed_write.py checks it)
SUFFIXES = (
    "weight",
    "weight_packed",
    "weight_scale",
    "weight_shape",
    "weight_zero_point",
    "weight_global_scale",
    "input_global_scale",
    "input_scale",
)


def codec_of(scheme: Any) -> CheckpointFormat:
    """The compressed-tensors codec of one scheme (BadInput when it has none)."""
    return get_format("compressed-tensors", scheme.kind)


def _group_of(scheme: Any) -> dict[str, Any]:
    """The config group the scheme's own codec writes (its only one), with that codec's format."""
    cfg = codec_of(scheme).config(scheme, [])
    (group,) = cfg["config_groups"].values()
    return {**group, "format": cfg["format"]}


def group_schemes(schemes: Mapping[str, Any]) -> list[tuple[Any, list[str]]]:
    """[(scheme, sorted linear names)] for {linear: scheme}, one entry per distinct config
    group, in order of first appearance by name."""
    out: dict[str, tuple[Any, list[str]]] = {}
    for name in sorted(schemes):
        key = repr(sorted(_group_of(schemes[name]).items(), key=lambda kv: kv[0]))
        out.setdefault(key, (schemes[name], []))[1].append(name)
    return list(out.values())


def quantization_config(schemes: Mapping[str, Any], ignore: Sequence[str]) -> dict[str, Any]:
    """`quantization_config` of a checkpoint whose linears have the schemes {linear: scheme}."""
    groups = {}
    for i, (scheme, names) in enumerate(group_schemes(schemes)):
        groups[f"group_{i}"] = {**_group_of(scheme), "targets": names}
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT_NAME,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(set(ignore)),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
    }


def _sub_config(quant_config: Mapping[str, Any], group: Mapping[str, Any]) -> dict[str, Any]:
    """A one-group config as that group's codec alone would have written it."""
    fmt = group.get("format")
    if not fmt or fmt == FORMAT_NAME:
        raise BadInput(
            f"a config group of this mixed-precision checkpoint has format {fmt!r}; each group needs its own "
            "(pack-quantized, float-quantized, nvfp4-pack-quantized, ...)"
        )
    return {**quant_config, "format": fmt, "config_groups": {"group_0": dict(group)}}


def _targeted(targets: Sequence[str], name: str) -> bool:
    return any(re.match(t[3:], name) if t.startswith("re:") else t == name for t in targets)


def assignment(quant_config: Mapping[str, Any], linears: Sequence[str]) -> dict[str, str]:
    """{linear: config group name} for the quantized `linears`: the first group whose targets
    name it (exact names before `re:` patterns, as vLLM matches); `Linear` takes the rest."""
    groups = quant_config.get("config_groups") or {}
    out: dict[str, str] = {}
    for name in linears:
        exact = [g for g, c in groups.items() if name in c.get("targets", ())]
        regex = [
            g for g, c in groups.items() if _targeted([t for t in c.get("targets", ()) if t.startswith("re:")], name)
        ]
        rest = [g for g, c in groups.items() if "Linear" in c.get("targets", ())]
        found = exact or regex or rest
        if not found:
            raise BadInput(f"quantized linear {name!r} is in no config group of this mixed-precision checkpoint")
        out[name] = found[0]
    return out


def _linear_names(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Module names that hold a quantized linear's tensors (any codec's scale)."""
    return sorted({k.rpartition(".")[0] for k in tensors if k.endswith((".weight_scale", ".weight_packed"))})


def read_layers(tensors: Mapping[str, torch.Tensor], quant_config: Mapping[str, Any]) -> dict[str, Any]:
    """{linear name: weight object}, each read by its group's codec from that linear's tensors."""
    groups = quant_config.get("config_groups") or {}
    where = assignment(quant_config, _linear_names(tensors))
    out: dict[str, Any] = {}
    for g, group in groups.items():
        names = {n for n, gn in where.items() if gn == g}
        if not names:
            continue
        sub = _sub_config(quant_config, group)
        codec = format_of(sub)
        mine = {k: v for k, v in tensors.items() if k.rpartition(".")[0] in names}
        out.update(codec.read(mine, sub))
    return out


def activations_by_linear(quant_config: Mapping[str, Any], linears: Sequence[str]) -> dict[str, bool]:
    """{linear: whether its group quantizes its input activations} (the codec's own answer)."""
    if quant_config.get("format") != FORMAT_NAME:
        quantized = format_of(quant_config).activations_quantized(quant_config)
        return dict.fromkeys(linears, quantized)
    groups = quant_config.get("config_groups") or {}
    where = assignment(quant_config, linears)
    per_group = {
        g: format_of(_sub_config(quant_config, c)).activations_quantized(_sub_config(quant_config, c))
        for g, c in groups.items()
    }
    return {n: per_group[g] for n, g in where.items()}


def _any_activations(quant_config: Mapping[str, Any]) -> bool:
    groups = (quant_config.get("config_groups") or {}).values()
    return any(
        format_of(_sub_config(quant_config, c)).activations_quantized(_sub_config(quant_config, c)) for c in groups
    )


def matches(quant_config: Mapping[str, Any]) -> bool:
    return quant_config.get("quant_method") == "compressed-tensors" and quant_config.get("format") == FORMAT_NAME


def _no_tensors(name: str, weight: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    raise BadInput("a mixed-precision checkpoint is written by packers/mixed_precision.write_mixed")


# Declared beside the number formats' codecs (packers/checkpoint._builtin): found by `format_of`.
FORMAT = CheckpointFormat(
    name="compressed-tensors",
    kind=KIND,
    suffixes=SUFFIXES,
    config=quantization_config,
    tensors=_no_tensors,
    read=read_layers,
    matches=matches,
    activations_quantized=_any_activations,
)


def write_mixed(
    model: nn.Module,
    quantized: Mapping[str, Any],
    schemes: Mapping[str, Any],
    out_dir: str | os.PathLike[str],
    src_dir: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    extra_files: ExtraFiles = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `model` with its linears `quantized` ({module name: weight object}), each under
    `schemes[name]`, as one mixed-precision checkpoint; `write_checkpoint`'s contract
    otherwise (ownership of `out_dir`, atomic rename, nothing left behind on failure).
    Linears of the model not in `quantized` are stored unquantized and listed in `ignore`.
    extra_files: {relative name: content}, or a function of the checkpoint's tensors
    ({name: tensor}, as stored) giving them (a report that counts the stored bytes)."""
    missing = sorted(set(quantized) ^ set(schemes))
    if missing:
        raise ValueError(f"quantized linears and schemes differ in {missing[:5]}")
    out = Path(out_dir)
    check_checkpoint_out(out, overwrite=overwrite, src_dir=src_dir)
    codecs = {n: codec_of(s) for n, s in schemes.items()}
    for n, s in schemes.items():
        codecs[n].check(s, {n: quantized[n]})
    ignore = ignored_linears(model, quantized)
    dtype = dtype or model_dtype(model)
    dispatch = CheckpointFormat(
        name="compressed-tensors",
        kind=KIND,
        suffixes=SUFFIXES,
        config=quantization_config,
        tensors=lambda name, w, dt: codecs[name].tensors(name, w, dt),
        read=read_layers,
        matches=matches,
    )
    with staging(out) as tmp:
        tensors = checkpoint_tensors(model, quantized, dispatch, None, dtype)
        if callable(extra_files):
            extra_files = extra_files(tensors)
        assemble(
            tmp,
            out,
            *in_memory(tensors),
            model,
            checkpoint_config(model, dispatch, schemes, ignore, dtype),
            src_dir,
            extra_files,
            max_shard_bytes,
        )
    return out
