"""Quantized checkpoints on disk: a registry of formats, `write_checkpoint` and
`read_checkpoint`.

A checkpoint is an HF model directory: safetensors (sorted keys, no timestamps; sharded
above `max_shard_bytes`), config.json with `quantization_config`, and the tokenizer /
chat template / generation config copied from the source model. Quantized linears are
written by their format's `tensors` function; every other tensor keeps the model dtype;
a tied output embedding is not written (it stays tied on load). The directory appears
atomically: everything goes into a temporary directory beside `out_dir`, renamed at the end.

A codec is declared by its number format (`formats/<format>/__init__.py`, the `codecs` of its
`NumberFormat`: "module:attribute" of a `CheckpointFormat`), or added by `register_format`.
This module knows nothing about any format's tensors.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infer_tool.common.errors import BadInput
from infer_tool.common.outdir import check_out_dir, make_readable, replace_dir, sign
from infer_tool.packers.shards import SAFETENSORS_INDEX, in_memory, write_shards

DEFAULT_SHARD_BYTES = 5 * 10**9  # Hugging Face's default max_shard_size, "5GB"
REPORT_NAME = "quantize_report.json"  # our checkpoints hold it: --overwrite may replace only those
# Files of the source model that travel with the weights.
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "preprocessor_config.json",
)
# What a checkpoint directory written before owner records (common/outdir.py) holds, and
# the keys its report has: how --overwrite recognises one of those.
CHECKPOINT_FILES = re.compile(
    "|".join(
        [r"config\.json", r"model(-\d{5}-of-\d{5})?\.safetensors", re.escape(SAFETENSORS_INDEX), re.escape(REPORT_NAME)]
        + [re.escape(n) for n in COPIED_FILES]
    )
)
REPORT_KEYS = ("model", "method", "scheme", "format")


def check_checkpoint_out(
    out: str | os.PathLike[str], *, overwrite: bool, src_dir: str | os.PathLike[str] | None = None
) -> None:
    """`check_out_dir` for a checkpoint directory (`src_dir`: the source model's, never replaced)."""
    check_out_dir(
        out,
        overwrite=overwrite,
        marker=REPORT_NAME,
        protected=[Path(src_dir)] if src_dir else [],
        legacy=CHECKPOINT_FILES,
        legacy_keys=REPORT_KEYS,
    )


def _no_check(scheme: Any, quantized: Mapping[str, Any]) -> None:
    return None


def _weights_only(quantization_config: Mapping[str, Any]) -> bool:
    return False


def group_quantizes_inputs(quantization_config: Mapping[str, Any]) -> bool:
    """True when a compressed-tensors config's first group quantizes its input activations."""
    groups = list(quantization_config.get("config_groups", {}).values())
    return bool(groups) and bool(groups[0].get("input_activations"))


@dataclass(frozen=True)
class CheckpointFormat:
    """How one on-disk format writes and reads quantized linears.

    name: the `--format` value; kind: the scheme kind it carries (`Scheme.kind`; one name may
    exist for several kinds).
    suffixes: tensor-name suffixes one quantized linear owns (e.g. "weight_packed").
    config(scheme, ignore) -> the `quantization_config` dict (ignore: unquantized linears).
    tensors(name, weight, model_dtype) -> {full tensor name: tensor} for one linear.
    read(tensors, quantization_config) -> {linear name: weight object}.
    matches(quantization_config) -> True when a checkpoint is in this format.
    check(scheme, quantized) raises BadInput before anything is written.
    scale_dtype: the dtype the format stores INT scales in whatever the model's (AutoAWQ
    and GPTQ v1: float16), or None for the model dtype; solvers round scales to it.
    """

    name: str
    kind: str
    suffixes: tuple[str, ...]
    config: Callable[[Any, Sequence[str]], dict[str, Any]]
    tensors: Callable[[str, Any, torch.dtype], dict[str, torch.Tensor]]
    read: Callable[[Mapping[str, torch.Tensor], Mapping[str, Any]], dict[str, Any]]
    matches: Callable[[Mapping[str, Any]], bool]
    check: Callable[[Any, Mapping[str, Any]], None] = field(default=_no_check)
    scale_dtype: str | None = None
    activations_quantized: Callable[[Mapping[str, Any]], bool] = field(default=_weights_only)


_REGISTERED: dict[tuple[str, str], CheckpointFormat] = {}


def register_format(fmt: CheckpointFormat) -> None:
    _REGISTERED[(fmt.name, fmt.kind)] = fmt


def _builtin() -> dict[tuple[str, str], str]:
    """{(`--format` name, kind): "module:attribute"}: the codecs every number format declares."""
    from infer_tool.formats.registry import all_formats

    found = {key: spec for f in all_formats() for key, spec in f.codecs.items()}
    found[("compressed-tensors", "mixed")] = (
        "infer_tool.packers.codecs.mixed_precision:FORMAT"  # several formats' groups
    )
    return found


def _load(spec: str) -> CheckpointFormat:
    module, attr = spec.split(":")
    return getattr(importlib.import_module(module), attr)


def all_formats() -> list[CheckpointFormat]:
    found = {key: _load(spec) for key, spec in _builtin().items()}
    found.update(_REGISTERED)
    return [found[k] for k in sorted(found)]


def get_format(name: str, kind: str = "int") -> CheckpointFormat:
    """The registered format `name` for weights of `kind`; BadInput names the accepted ones."""
    if (name, kind) in _REGISTERED:
        return _REGISTERED[(name, kind)]
    builtin = _builtin()
    if (name, kind) in builtin:
        return _load(builtin[(name, kind)])
    accepted = sorted({n for n, k in list(builtin) + list(_REGISTERED) if k == kind})
    raise BadInput(f"format {name!r} is not supported for {kind} weights; use one of {', '.join(accepted)}")


# Formats other tools write that we read (eval, convert) and never write: no `--format` offers them.
READ_ONLY = ("infer_tool.packers.codecs.modelopt_nvfp4:FORMAT", "infer_tool.packers.codecs.modelopt_fp8:FORMAT")


def format_of(quantization_config: Mapping[str, Any]) -> CheckpointFormat:
    for fmt in all_formats() + [_load(spec) for spec in READ_ONLY]:
        if fmt.matches(quantization_config):
            return fmt
    method = quantization_config.get("quant_method")
    raise BadInput(f"quantization_config with quant_method={method!r} is not a format we read")


# ---------------------------------------------------------------- writing


def _tied_duplicates(model: nn.Module, state: Mapping[str, torch.Tensor]) -> set[str]:
    """Names to leave out because they share storage with another tensor (tied weights).

    The output embedding is the one dropped when it is tied to the input embedding.
    """
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out_name = None
    if out_emb is not None:
        for name, module in model.named_modules():
            if module is out_emb:
                out_name = f"{name}.weight"
    seen: dict[tuple[int, tuple[int, ...]], str] = {}
    drop: set[str] = set()
    for name in sorted(state, key=lambda n: (n == out_name, n)):
        t = state[name]
        if t.device.type == "meta" or t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size(), tuple(t.shape))
        if key in seen:
            drop.add(name)
        else:
            seen[key] = name
    return drop


def _linear_names(model: nn.Module) -> list[str]:
    return sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear))


def model_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def checkpoint_tensors(
    model: nn.Module,
    quantized: Mapping[str, Any],
    fmt: CheckpointFormat,
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    within: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """{tensor name: tensor} of the checkpoint, sorted by name, contiguous, on CPU.

    Floating-point model tensors are cast to `dtype` (default: the model's dtype). With
    `within`, only the model tensors whose names it accepts (one decoder layer, or all but
    the layers: a streamed run writes its checkpoint in such parts); tensors still on the
    meta device are never written.
    """
    state = model.state_dict()
    drop = _tied_duplicates(model, state)
    dtype = dtype or model_dtype(model)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name in drop or (within is not None and not within(name)):
            continue
        if t.device.type == "meta":
            raise ValueError(f"{name} is not loaded (meta device); it cannot be written")
        out[name] = t.to(dtype) if t.is_floating_point() else t
    for name, w in quantized.items():
        if f"{name}.weight" in drop:
            raise BadInput(f"{name!r} is tied to another tensor (tied embeddings); leave it unquantized")
        if f"{name}.weight" not in out:
            raise BadInput(f"quantized layer {name!r} has no weight in the model's state dict")
        del out[f"{name}.weight"]
        out.update(fmt.tensors(name, w, dtype))
    out.update(extra_tensors or {})
    return {k: out[k].detach().to("cpu").contiguous() for k in sorted(out)}


def checkpoint_config(
    model: nn.Module, fmt: CheckpointFormat, scheme: Any, ignore: Sequence[str], dtype: torch.dtype
) -> dict[str, Any]:
    """config.json of the checkpoint: the model's config, its dtype, `quantization_config`."""
    config_obj = getattr(model, "config", None)
    if config_obj is None:
        raise BadInput("the model has no HF config; write_checkpoint needs a transformers model")
    config = json.loads(config_obj.to_json_string(use_diff=False))
    config["dtype"] = str(dtype).removeprefix("torch.")
    if "torch_dtype" in config:
        config["torch_dtype"] = config["dtype"]
    config["quantization_config"] = fmt.config(scheme, ignore)
    return config


def ignored_linears(
    model: nn.Module,
    quantized: Mapping[str, Any],
    unquantized: Sequence[str] = (),
    rename: Callable[[str], str] | None = None,
) -> list[str]:
    """`quantization_config.ignore`: the model's nn.Linear modules left unquantized, plus
    `unquantized` (MoE routers), as the checkpoint names them (`rename`); BadInput when a
    quantized name is not a linear of the model."""
    linears = set(_linear_names(model))
    missing = sorted(set(quantized) - linears)
    if missing:
        raise BadInput(f"quantized layers {missing[:5]} are not linear modules of the model")
    return sorted((rename or str)(n) for n in (linears - set(quantized)) | set(unquantized))


def fill_directory(
    tmp: Path,
    model: nn.Module,
    config: Mapping[str, Any],
    src_dir: str | os.PathLike[str] | None,
    extra_files: Mapping[str, str | bytes] | None,
) -> None:
    """config.json, the source's tokenizer / chat template / generation config, and the extra files."""
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if src_dir is not None:
        for name in COPIED_FILES:
            src = Path(src_dir) / name
            if src.is_file():
                shutil.copyfile(src, tmp / name)
    gen = getattr(model, "generation_config", None)
    if not (tmp / "generation_config.json").exists() and gen is not None:
        gen.to_json_file(str(tmp / "generation_config.json"))
    for name, content in (extra_files or {}).items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def publish(tmp: Path, out: Path) -> None:
    """Sign `tmp` as ours, make it readable and rename it to `out` (an existing `out`, ours, is
    replaced: `common/outdir.replace_dir`)."""
    sign(tmp, "checkpoint", REPORT_NAME)
    make_readable(tmp)
    replace_dir(tmp, out, REPORT_NAME, CHECKPOINT_FILES, REPORT_KEYS)


def assemble(
    tmp: Path,
    out: Path,
    specs: Sequence[Any],
    load: Callable[[str], torch.Tensor],
    model: nn.Module,
    config: Mapping[str, Any],
    src_dir: str | os.PathLike[str] | None,
    extra_files: Mapping[str, str | bytes] | None,
    max_shard_bytes: int,
) -> None:
    """The checkpoint's shards from `specs` / `load(name)`, its config and copied files, all in
    `tmp`, then renamed to `out` (the caller removes `tmp` on failure)."""
    write_shards(
        tmp,
        specs,
        load,
        max_shard_bytes,
        total_parameters=model.num_parameters() if hasattr(model, "num_parameters") else None,
    )
    fill_directory(tmp, model, config, src_dir, extra_files)
    publish(tmp, out)


def write_checkpoint(
    model: nn.Module,
    quantized: Mapping[str, Any],
    fmt: str,
    scheme: Any,
    out_dir: str | os.PathLike[str],
    src_dir: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    extra_files: Mapping[str, str | bytes] | None = None,
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    rename: Callable[[str], str] | None = None,
    unquantized: Sequence[str] = (),
) -> Path:
    """Write `model` with its linears `quantized` ({module name: weight}) as format `fmt`.

    model: the transformers model holding the unquantized tensors (its quantized linears'
        `.weight` are replaced by the format's tensors). scheme: the QuantScheme (or FP8
        scheme) used. extra_files: {relative name: content} (e.g. quantize_report.json).
    extra_tensors: more tensors to store (e.g. KV-cache scales). dtype: of the unquantized
    tensors (and compressed-tensors scales); default the model's. rename: module / tensor
    name -> the name the checkpoint stores (the original checkpoint's spelling of an MoE's
    experts); unquantized: more modules for the config's ignore list (MoE routers, which
    are not nn.Linear in transformers but are linears to vLLM). Returns out_dir.
    Raises BadInput for an existing out_dir (unless overwrite) or a format that cannot carry
    the scheme; on any failure nothing is left behind.
    """
    out = Path(out_dir)
    fmt_obj = get_format(fmt, scheme.kind)
    check_checkpoint_out(out, overwrite=overwrite, src_dir=src_dir)
    fmt_obj.check(scheme, quantized)
    ignore = ignored_linears(model, quantized, unquantized, rename)

    with staging(out) as tmp:
        dtype = dtype or model_dtype(model)
        tensors = checkpoint_tensors(model, quantized, fmt_obj, extra_tensors, dtype)
        if rename is not None:
            tensors = {rename(k): v for k, v in tensors.items()}
        assemble(
            tmp,
            out,
            *in_memory(tensors),
            model,
            checkpoint_config(model, fmt_obj, scheme, ignore, dtype),
            src_dir,
            extra_files,
            max_shard_bytes,
        )
    return out


@contextlib.contextmanager
def staging(out: Path) -> Iterator[Path]:
    """A fresh hidden directory beside `out` to assemble a checkpoint in (`assemble` renames it
    to `out`); removed if the block fails or is interrupted, so nothing is left behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---------------------------------------------------------------- reading


def load_tensors(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (single file or sharded with an index)."""
    from safetensors.torch import load_file

    d = Path(directory)
    index = d / SAFETENSORS_INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise BadInput(f"{str(d)!r} holds no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(d / f)))
    return tensors


def modelopt_config(directory: Path) -> dict[str, Any] | None:
    """A legacy ModelOpt export's hf_quant_config.json as its quantization_config, or None."""
    from infer_tool.packers.codecs.modelopt_config import hf_quant_config

    return hf_quant_config(directory)


def read_checkpoint(
    directory: str | os.PathLike[str],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, {linear name: weight object}, {other tensor name: tensor}).

    The weight objects are `QuantizedWeight` for INT formats (Fp8Weight for FP8 ones).
    """
    d = Path(directory)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise BadInput(f"{str(d)!r} has no config.json; expected a checkpoint directory")
    config = json.loads(cfg_path.read_text())
    qcfg = config.get("quantization_config") or modelopt_config(d)
    if not qcfg:
        raise BadInput(f"{str(d)!r} is not quantized (config.json has no quantization_config)")
    config["quantization_config"] = qcfg
    fmt = format_of(qcfg)
    tensors = load_tensors(d)
    layers = fmt.read(tensors, qcfg)
    owned = {f"{name}.{s}" for name in layers for s in fmt.suffixes}
    rest = {k: v for k, v in tensors.items() if k not in owned}
    return config, layers, rest
