"""Mechanics of running one decoder layer on calibration activations: how a layer is
called, the weights of its linears as (N, K), input capture for the first layer, and the
forward hooks that measure or keep what its linears see.

- `capture_inputs`: the decoder layers are swapped for recorders and the calibration
  batch is run through the model; the recorders keep what each layer is called with
  (positional args, attention masks, position embeddings, per layer because Gemma's
  sliding-window layers get other masks and rotary tables) and the last one stops the
  forward with a sentinel exception, so only the embeddings run (the
  llm-compressor/AutoAWQ "Catcher").
- `run_layer` / `run_until`: a layer's outputs per chunk, or a run stopped at a module.
- `capturing_inputs` / `capturing_calls`: pre-hooks adding each input to statistics
  accumulators (and keeping some), or keeping a module's calls and outputs.

Activations are lists of chunks: X[c] (b, T, D) with calls[c] the layer's other
arguments for that chunk. This module knows no quantization method and no file format.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import re
import resource
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from infer_tool.calib.architectures import Architecture, get_submodule
from infer_tool.calib.distributed import chunks, gather_terms
from infer_tool.calib.stats import StatsAccumulator
from infer_tool.common.errors import BadInput


class StopForward(Exception):
    """Raised by a hook to end a forward pass once the needed input is captured."""


@dataclass
class LayerCall:
    """What a decoder layer is called with for one chunk of sequences."""

    args: tuple[Any, ...]  # positional args after hidden_states
    kwargs: dict[str, Any]


def weight_nk(module: nn.Module, conv1d: bool) -> torch.Tensor:
    """The weight as (N, K) = (out, in); a view for nn.Linear, a transpose view for Conv1D."""
    return module.weight.T if conv1d else module.weight


@torch.no_grad()
def set_weight_nk(module: nn.Module, W: torch.Tensor, conv1d: bool) -> None:
    """Copy an (N, K) weight into the module (transposed for Conv1D)."""
    target = module.weight
    target.copy_((W.T if conv1d else W).to(target.dtype))


def matches(name: str, patterns: tuple[str, ...]) -> bool:
    """True when `name` matches a glob pattern, or a regex written `re:PATTERN`."""
    for p in patterns:
        if p.startswith("re:"):
            if re.search(p[3:], name):
                return True
        elif fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, f"*.{p}"):
            return True
    return False


def first(out: Any) -> torch.Tensor:
    """A module's (first) output tensor."""
    return out[0] if isinstance(out, (tuple, list)) else out


def to_device(obj: Any, device: torch.device, moved: dict[int, torch.Tensor] | None = None) -> Any:
    """`obj` with every tensor in it (tuples, lists, dicts) moved to `device`; with `moved`,
    a tensor met again (the rotary tables every layer is called with) is moved once."""
    if isinstance(obj, torch.Tensor):
        if moved is None:
            return obj.to(device)
        if id(obj) not in moved:
            moved[id(obj)] = obj.to(device)
        return moved[id(obj)]
    if isinstance(obj, tuple):
        return tuple(to_device(o, device, moved) for o in obj)
    if isinstance(obj, list):
        return [to_device(o, device, moved) for o in obj]
    if isinstance(obj, dict):
        return {k: to_device(v, device, moved) for k, v in obj.items()}
    return obj


def peak_memory(device: torch.device) -> dict[str, float]:
    """Peak RSS of this process (MiB) and, on CUDA, peak allocated device memory (MiB)."""
    out = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
    if device.type == "cuda":
        out["cuda_peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def decoder_layers(model: nn.Module, arch: Architecture) -> nn.ModuleList:
    layers = get_submodule(model, arch.layers)
    if not isinstance(layers, nn.ModuleList):
        raise BadInput(f"{arch.layers} is not a module list in {type(model).__name__}")
    return layers


def linear_shapes(model: nn.Module, arch: Architecture) -> dict[str, tuple[int, int]]:
    """{full linear name: (N, K)} for every linear the table names (each expert's too, once
    `calib/moe.unfuse_experts` has made them linears)."""
    shapes = {}
    for i, layer in enumerate(decoder_layers(model, arch)):
        for name in arch.layer_linears(layer):
            n, k = weight_nk(get_submodule(layer, name), arch.conv1d).shape
            shapes[f"{arch.layers}.{i}.{name}"] = (int(n), int(k))
    return shapes


def group_modules(layer: nn.Module, arch: Architecture) -> dict[str, nn.Module]:
    """{first linear name of each group: that linear}; the group's linears share its input."""
    return {group[0]: get_submodule(layer, group[0]) for group in arch.groups}


def group_of(arch: Architecture, name: str) -> str:
    """The first linear of the group `name` belongs to (the key of its shared statistics)."""
    for group in arch.groups:
        if name in group:
            return group[0]
    raise KeyError(name)


def relative_error(Y_hat: list[torch.Tensor], Y: list[torch.Tensor]) -> float:
    """‖Ŷ − Y‖ / ‖Y‖ over every chunk (of every process), in float64, summed in chunk order."""
    terms = gather_terms(
        [(float((a.double() - b.double()).pow(2).sum()), float(b.double().pow(2).sum())) for a, b in zip(Y_hat, Y)]
    )
    num = sum(t[0] for t in terms)
    den = sum(t[1] for t in terms)
    if not (math.isfinite(num) and math.isfinite(den)):
        return math.nan  # a NaN or infinite output: the caller names the layer
    return (num / den) ** 0.5 if den > 0 else 0.0


# ---------------------------------------------------------------- capture


class _Recorder(nn.Module):
    """Stands in for decoder layer i during capture: records its call, passes x through."""

    def __init__(self, index: int, sink: list[LayerCall], first: list[torch.Tensor], last: bool) -> None:
        super().__init__()
        self.index, self.sink, self.first, self.last = index, sink, first, last

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.index == 0:
            self.first.append(hidden_states)
        self.sink.append(LayerCall(args, kwargs))
        if self.last:
            raise StopForward
        return hidden_states


@torch.no_grad()
def capture_inputs(
    model: nn.Module, arch: Architecture, input_ids: torch.Tensor, batch_size: int, device: torch.device
) -> tuple[list[torch.Tensor], list[list[LayerCall]]]:
    """Run the embeddings on chunks of `input_ids` (B, T).

    Returns X, the first decoder layer's inputs as chunks (b, T, D) on `device`, and
    calls[layer][chunk], what each layer is called with for each chunk.
    """
    layers = decoder_layers(model, arch)
    L = len(layers)
    originals = list(layers)
    calls: list[list[LayerCall]] = [[] for _ in range(L)]
    X: list[torch.Tensor] = []
    model_device = model.get_input_embeddings().weight.device  # other layers may be unloaded (meta)
    try:
        for i in range(L):
            layers[i] = _Recorder(i, calls[i], X, last=i == L - 1)
        for start in range(0, input_ids.shape[0], batch_size):
            chunk = input_ids[start : start + batch_size].to(model_device)
            try:
                model(input_ids=chunk, use_cache=False)
            except StopForward:
                pass
    finally:
        for i in range(L):
            layers[i] = originals[i]
    X = [x.to(device) for x in X]
    moved: dict[int, torch.Tensor] = {}  # kept alive with the originals in `calls` until the end
    calls = [
        [LayerCall(to_device(c.args, device, moved), to_device(c.kwargs, device, moved)) for c in per_layer]
        for per_layer in calls
    ]
    return X, calls


# ---------------------------------------------------------------- layer runs and hooks


@torch.no_grad()
def run_layer(layer: nn.Module, X: list[torch.Tensor], calls: list[LayerCall], start: int = 0) -> list[torch.Tensor]:
    """The layer's outputs for each input chunk (X[0] being this process's chunk `start`)."""
    return [first(layer(x, *c.args, **c.kwargs)) for x, c in chunks(zip(X, calls), start)]


@torch.no_grad()
def run_until(layer: nn.Module, X: list[torch.Tensor], calls: list[LayerCall], stop_at: nn.Module) -> None:
    """Run chunks through the layer, stopping each one after `stop_at`'s pre-hooks."""
    run_until_all(layer, X, calls, [stop_at])


@torch.no_grad()
def run_until_all(layer: nn.Module, X: list[torch.Tensor], calls: list[LayerCall], stop_at: list[nn.Module]) -> None:
    """Run chunks through the layer, stopping each one once every module of `stop_at` has run
    its pre-hooks (in whichever order the forward reaches them)."""
    need, seen = {id(m) for m in stop_at}, set()

    def stop(module: nn.Module, args: Any) -> None:
        seen.add(id(module))
        if seen == need:
            raise StopForward

    handles = [m.register_forward_pre_hook(stop) for m in stop_at]
    try:
        for x, c in chunks(zip(X, calls)):
            seen.clear()
            try:
                layer(x, *c.args, **c.kwargs)
            except StopForward:
                pass
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def capturing_inputs(
    modules: dict[str, nn.Module],
    accs: dict[str, StatsAccumulator] | None = None,
    keep: dict[str, list[torch.Tensor]] | None = None,
    keep_chunks: int = 0,
    stop: bool = False,
) -> Iterator[None]:
    """Pre-hooks on `modules`: add each input to `accs[key]`; for the first `keep_chunks`
    calls also keep the input in `keep[key]`; with `stop`, end the forward there."""
    seen = {key: 0 for key in modules}

    def hook(key: str) -> Callable[..., None]:
        def fn(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            if accs is not None:
                accs[key].add(x)
            if keep is not None and seen[key] < keep_chunks:
                keep[key].append(x)
            seen[key] += 1
            if stop:
                raise StopForward

        return fn

    handles = [m.register_forward_pre_hook(hook(key)) for key, m in modules.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def capturing_calls(
    modules: dict[str, nn.Module],
    calls: dict[str, list[LayerCall]],
    outputs: dict[str, list[torch.Tensor]],
    keep_chunks: int,
) -> Iterator[None]:
    """Keep the (args, kwargs) and output of each module's first `keep_chunks` calls."""
    seen = {key: 0 for key in modules}
    handles = []
    for key, m in modules.items():

        def pre(module: nn.Module, args: tuple, kwargs: dict, key: str = key) -> None:
            if seen[key] < keep_chunks:
                calls[key].append(LayerCall(args, dict(kwargs)))

        def post(module: nn.Module, args: tuple, kwargs: dict, out: Any, key: str = key) -> None:
            if seen[key] < keep_chunks:
                outputs[key].append(first(out))
            seen[key] += 1

        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
