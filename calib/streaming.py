"""A causal LM built without its weights, whose tensors are brought in from the source
safetensors one module at a time and released after.

- `WeightFiles`: the tensors of a model directory: one `model.safetensors`, or the shards
  `model.safetensors.index.json` lists, known from their headers. Each read copies the
  tensors it asks for out of the file with positioned reads (not a memory map of the
  whole shard, see `packers/safetensors_stream.py`), so nothing else of the file is held.
- `skeleton`: the model built from its config with every parameter on the meta device (no
  memory) and its non-persistent buffers (rotary tables, embedding scales) computed as
  usual; tied weights are tied (one Parameter).
- `stream_plan`: whether the files hold every tensor the skeleton needs under its own
  names and shapes (else the caller loads the whole model the usual way, and says why).
- `materialize(model, prefixes, ...)`: the parameters and persistent buffers under those
  module prefixes, read, cast to the compute dtype, rounded through the storage dtype, on
  a device; `release` puts them back on the meta device.

What this module does not know: decoder layers, quantization, checkpoint formats.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infer_tool.common.errors import BadInput, untrusted

SAFETENSORS_INDEX = "model.safetensors.index.json"


class WeightFiles:
    """{tensor name: file} over a model directory's safetensors files, from their headers
    (the index's weight map is checked against them); tensors read on demand."""

    def __init__(self, directory: Path) -> None:
        from infer_tool.common.safetensors_header import tensor_headers

        self.directory = Path(directory)
        index = self.directory / SAFETENSORS_INDEX
        if index.is_file():
            with untrusted(f"{index}"):
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            paths = [self.directory / f for f in files]
        else:
            paths = sorted(self.directory.glob("*.safetensors"))
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in paths:
            if not path.is_file():
                raise BadInput(f"{index} lists {path.name}, which is missing")
            header, start = tensor_headers(path)
            with untrusted(f"{path}: not a readable safetensors file"):
                end = max((int(info["data_offsets"][1]) for info in header.values()), default=0)
                for name, info in header.items():
                    self.where[name] = path
                    self.shapes[name] = tuple(int(d) for d in info["shape"])
            if path.stat().st_size < start + end:
                raise BadInput(f"{path} is truncated: {path.stat().st_size} bytes, its header needs {start + end}")
        if not self.where:
            raise BadInput(f"{self.directory} holds no safetensors weights")

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors as stored (their dtype), read file by file."""
        from infer_tool.packers.safetensors_stream import read_tensors

        by_file: dict[Path, list[str]] = defaultdict(list)
        for name in names:
            by_file[self.where[name]].append(name)
        out = {}
        for path, group in sorted(by_file.items()):
            with untrusted(f"{path}"):
                out.update(read_tensors(path, group))
        return out


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters made on the meta device while their modules' own code computes the
    buffers (rotary tables, embedding scales) on the CPU: accelerate's init_empty_weights
    moves each parameter to meta as it is registered, and `torch.empty` without a device
    (how nn.Linear / nn.Embedding allocate their weights) makes meta tensors here, so
    not even a transient copy of a weight is allocated."""
    from accelerate import init_empty_weights

    empty = torch.empty

    def meta_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return empty(*args, **kwargs)

    torch.empty = meta_empty
    try:
        with init_empty_weights(include_buffers=False):
            yield
    finally:
        torch.empty = empty


def skeleton(directory: Path, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model of `directory`'s config, parameters on the meta device, tied weights tied."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=trust_remote_code)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()
    return model.eval()


@dataclass
class Slot:
    """Where one tensor of the model lives: every (module, attribute) holding it."""

    name: str  # the name it is read under
    holders: list[tuple[nn.Module, str, bool]]  # (module, attribute, is_parameter)
    aliases: list[str]  # other state-dict names of the same tensor (tied)


def slots(model: nn.Module) -> dict[str, Slot]:
    """{name: Slot} for every parameter and persistent buffer, tied tensors once (under
    their first name in module order)."""
    seen: dict[int, Slot] = {}
    out: dict[str, Slot] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        entries = [(n, p, True) for n, p in module._parameters.items() if p is not None]
        entries += [
            (n, b, False)
            for n, b in module._buffers.items()
            if b is not None and n not in module._non_persistent_buffers_set
        ]
        for leaf, t, is_param in entries:
            slot = seen.get(id(t))
            if slot is None:
                slot = seen[id(t)] = out[f"{prefix}{leaf}"] = Slot(f"{prefix}{leaf}", [], [])
            elif f"{prefix}{leaf}" != slot.name and f"{prefix}{leaf}" not in slot.aliases:
                slot.aliases.append(f"{prefix}{leaf}")
            if (module, leaf, is_param) not in [(m, a, p) for m, a, p in slot.holders]:
                slot.holders.append((module, leaf, is_param))
    return out


def stream_plan(model: nn.Module, files: WeightFiles) -> tuple[dict[str, str], str | None]:
    """({slot name: file tensor name}, None) when the files hold every tensor the model
    needs with its shape, else ({}, why not)."""
    shapes = files.shapes
    plan: dict[str, str] = {}
    for name, slot in slots(model).items():
        found = next((n for n in (name, *slot.aliases) if n in shapes), None)
        if found is None:
            return {}, f"the weight files have no tensor {name!r}"
        want = tuple(_current(slot).shape)
        if shapes[found] != want:
            return {}, f"{found} is {list(shapes[found])} in the files but {list(want)} in the model"
        plan[name] = found
    return plan, None


def _current(slot: Slot) -> torch.Tensor:
    module, attr, is_param = slot.holders[0]
    return module._parameters[attr] if is_param else module._buffers[attr]


def materialize(
    model: nn.Module,
    names: Iterable[str],
    plan: dict[str, str],
    files: WeightFiles,
    device: torch.device,
    round_dtype: torch.dtype | None,
) -> None:
    """Read the slots `names`, cast them to their skeleton dtype, round floating tensors
    through `round_dtype` (as `from_pretrained` then rounding would), and put them on
    `device` in every module holding them. On the CPU each tensor has its own memory map
    (`mapped_empty`), given back when it is released."""
    from infer_tool.packers.safetensors_stream import mapped_empty

    table = slots(model)
    wanted = [table[n] for n in names]
    tensors = files.read(plan[s.name] for s in wanted)
    for slot in wanted:
        like = _current(slot)
        t = tensors.pop(plan[slot.name])
        if t.dtype != like.dtype:
            cast = mapped_empty(t.numel() * like.element_size()).view(like.dtype).reshape(t.shape)
            t = cast.copy_(t)
        if round_dtype is not None and t.is_floating_point() and round_dtype != t.dtype:
            t.copy_(t.to(round_dtype))
        _assign(slot, t.to(device))


def release(model: nn.Module, names: Iterable[str]) -> None:
    """Put the slots `names` back on the meta device (their memory is freed)."""
    table = slots(model)
    for n in names:
        like = _current(table[n])
        _assign(table[n], torch.empty_like(like, device="meta"))


def _assign(slot: Slot, t: torch.Tensor) -> None:
    """One object for every holder, so tied tensors stay one tensor."""
    param = nn.Parameter(t, requires_grad=False) if any(p for _, _, p in slot.holders) else None
    for module, attr, is_param in slot.holders:
        if is_param:
            module._parameters[attr] = param
        else:
            module._buffers[attr] = t


def resident_bytes() -> int | None:
    """The process's resident set size now (Linux's /proc/self/statm); None where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def trim_heap(above: int | None = None) -> None:
    """Give freed heap memory back to the OS (glibc's malloc_trim; a no-op elsewhere). glibc
    serves allocations below its adaptive mmap threshold (up to 32 MB: most weights) from its
    heap and keeps them there once freed, fragmented, where they count in RSS: without this,
    a streamed run's RSS creeps up by about one layer's tensors per layer. With `above`
    (bytes), only while the resident set exceeds it: every trim makes the next layer's
    allocations fault their pages in again."""
    if above is not None:
        rss = resident_bytes()
        if rss is not None and rss <= above:
            return
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
            _LIBC and _LIBC.malloc_trim  # noqa: B018 - absent outside glibc
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: Any = None


def put_buffers(module: nn.Module, device: torch.device) -> None:
    """Move the module's non-meta buffers (e.g. a per-layer rotary table) to `device`."""
    for sub in module.modules():
        for k, b in sub._buffers.items():
            if b is not None and b.device.type != "meta" and b.device != device:
                sub._buffers[k] = b.to(device)


def open_model(spec: str, *, stream: bool, allow_pickle: bool = False, trust_remote_code: bool = False) -> Any:
    """A plain causal LM for the layer-by-layer pipeline, in float32. With `stream`, the model
    is built without its weights (meta device), which stay in the safetensors files until a
    layer needs them (`calib/streaming.py`); when the files do not hold every tensor under
    the model's own names and shapes (pickle weights, renamed keys), it is loaded whole and
    a note says why."""
    from infer_tool.calib.models import check_config, load_from_dir, load_tokenizer, refuse_quantized, resolve_model_dir

    directory, notes = resolve_model_dir(spec, allow_pickle)
    if stream:
        refuse_quantized(spec, directory)
        check_config(directory, trust_remote_code)
        why = "its weights are not in safetensors files"
        if any(directory.glob("*.safetensors")):
            where = spec if Path(spec).expanduser().resolve() == directory.resolve() else f"{spec} ({directory})"
            with untrusted(f"model {where} could not be loaded"):
                model = skeleton(directory, trust_remote_code)
            try:
                files = WeightFiles(directory)
            except BadInput as e:
                raise BadInput(f"model {where} could not be loaded: {e}") from None
            plan, why = stream_plan(model, files)
            if why is None:
                tokenizer = load_tokenizer(directory, trust_remote_code)
                from infer_tool.calib.models import LoadedModel

                return LoadedModel(model, tokenizer, spec, directory, notes, files=files, stream_plan=plan)
        notes = [*notes, f"the whole model was loaded, not streamed layer by layer: {why}"]
    return load_from_dir(spec, directory, notes, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
