"""The layer-by-layer calibration pipeline: capture each decoder layer's inputs, measure
its linears' statistics, run a solver, and propagate the quantized layer's outputs.

1. Capture: the decoder layers are swapped for recorders and the calibration batch is run
   through the model; the recorders keep what each layer is called with (positional args,
   attention masks, position embeddings, per layer because Gemma's sliding-window layers
   get other masks and rotary tables) and the last one stops the forward with a sentinel
   exception, so only the embeddings run (the llm-compressor/AutoAWQ "Catcher").
2. For each decoder layer, on the device: the fp output Y on the calibration inputs X,
   then the solver:
   - RTN: every linear alone;
   - GPTQ, true-sequential: for each linear group of the architecture table (q/k/v, then
     o, then gate/up, then down), re-run the layer (stopping at the group) so the group's
     Hessian is measured on inputs that went through the already-quantized earlier groups.
     A sub-block whose output is its last linear's output (attention -> o_proj, MLP ->
     down_proj; checked on the first chunk) is final once that linear is quantized: later
     runs replay its cached output, so attention runs once per layer, not four times;
   - AWQ, per block: scale search per mapping on a subsample of sequences (block-output MSE
     of the inspected module; from the Gram matrix XᵀX when that module is the balanced
     linear itself), fold the scales, clip search, RTN;
   the weights are replaced by their dequantized values, the layer is run again to give
   Ŷ, the next layer's inputs, and the relative error ‖Ŷ − Y‖/‖Y‖ on the first
   ERROR_SAMPLES sequences is recorded. Solvers that read no activations (RTN, dynamic
   FP8) run only those sequences.
3. `collect_stats` runs the same loop without quantizing (for `calibrate --out`):
   every layer's statistics are then measured on fp inputs.

Peak memory: the model's weights (on the CPU), one layer on the device, and the
calibration activations X, Y (B, T, D) on the device; GPTQ also keeps the current
layer's attention and MLP outputs (B, T, D) and, while down_proj is solved, its input (B, T, I).

This module knows nothing about file formats or the CLI; the solvers are packers'.
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from infer_tool.calib.stats import LayerStats, StatsAccumulator, relative_output_error
from infer_tool.common.errors import BadInput
from infer_tool.common.progress import Progress, no_progress
from infer_tool.packers.architectures import Architecture, AWQMapping, architecture_for, check_model, get_submodule
from infer_tool.packers.quantized import QuantizedWeight
from infer_tool.packers.scheme import AWQScheme, GPTQScheme, QuantScheme, check_group_size

# How the pipeline runs (not algorithm defaults: those live in packers/scheme.py).
BATCH_SIZE = 16  # sequences per layer forward on an accelerator
CPU_BATCH_TOKENS = 2048  # tokens per layer forward on a CPU: activations stay in cache (AWQ ~10% faster than 8192)
AWQ_SEARCH_SAMPLES = 16  # sequences the AWQ scale/clip searches run on
ERROR_SAMPLES = 16  # sequences the reported per-layer output error is measured on


class _StopForward(Exception):
    """Raised by a hook to end a forward pass once the needed input is captured."""


@dataclass
class LayerCall:
    """What a decoder layer is called with for one chunk of sequences."""

    args: tuple[Any, ...]  # positional args after hidden_states
    kwargs: dict[str, Any]


@dataclass
class PipelineResult:
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)  # full linear name -> result
    stats: dict[str, LayerStats] = field(default_factory=dict)  # full linear name -> stats (shared per group)
    layer_errors: list[dict[str, Any]] = field(default_factory=list)  # per decoder layer
    linear_errors: dict[str, float] = field(default_factory=dict)  # ‖ΔW X‖/‖W X‖ where H is known
    fallbacks: list[dict[str, Any]] = field(default_factory=list)
    awq: list[dict[str, Any]] = field(default_factory=list)  # per mapping: ratio, losses, skipped
    kv_amax: dict[str, Any] = field(default_factory=dict)  # FP8 KV cache: attention name -> KvAmax (calib/fp8_layers.py)
    ignored: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    tokens: int = 0


# ---------------------------------------------------------------- module helpers


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


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
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
    """{full linear name: (N, K)} for every linear the table names."""
    shapes = {}
    for i, layer in enumerate(decoder_layers(model, arch)):
        for name in arch.linears:
            n, k = weight_nk(get_submodule(layer, name), arch.conv1d).shape
            shapes[f"{arch.layers}.{i}.{name}"] = (int(n), int(k))
    return shapes


def plan(model: nn.Module, scheme: QuantScheme | None, ignore: tuple[str, ...] = ()) -> tuple[Architecture, list[str]]:
    """Check the model against the table and the group size against every K, before any work.

    Returns (architecture, names of the linears to quantize)."""
    arch = architecture_for(getattr(model.config, "model_type", "?"))
    check_model(model, arch)
    shapes = linear_shapes(model, arch)
    names = [n for n in shapes if not matches(n, ignore)]
    if scheme is not None:
        if isinstance(scheme, QuantScheme):  # FP8 schemes have no groups
            check_group_size({n: shapes[n] for n in names}, scheme.group_size)
    return arch, names


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
            raise _StopForward
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
    model_device = next(model.parameters()).device
    try:
        for i in range(L):
            layers[i] = _Recorder(i, calls[i], X, last=i == L - 1)
        for start in range(0, input_ids.shape[0], batch_size):
            chunk = input_ids[start : start + batch_size].to(model_device)
            try:
                model(input_ids=chunk, use_cache=False)
            except _StopForward:
                pass
    finally:
        for i in range(L):
            layers[i] = originals[i]
    X = [x.to(device) for x in X]
    calls = [[LayerCall(_to(c.args, device), _to(c.kwargs, device)) for c in per_layer] for per_layer in calls]
    return X, calls


# ---------------------------------------------------------------- layer runs


@torch.no_grad()
def run_layer(layer: nn.Module, X: list[torch.Tensor], calls: list[LayerCall]) -> list[torch.Tensor]:
    """The layer's outputs for each input chunk."""
    return [_first(layer(x, *c.args, **c.kwargs)) for x, c in zip(X, calls)]


@torch.no_grad()
def _run_until(layer: nn.Module, X: list[torch.Tensor], calls: list[LayerCall], stop_at: nn.Module) -> None:
    """Run chunks through the layer, stopping each one after `stop_at`'s pre-hooks."""

    def stop(module: nn.Module, args: Any) -> None:
        raise _StopForward

    handle = stop_at.register_forward_pre_hook(stop)
    try:
        for x, c in zip(X, calls):
            try:
                layer(x, *c.args, **c.kwargs)
            except _StopForward:
                pass
    finally:
        handle.remove()


@contextlib.contextmanager
def _capture_inputs(
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
                raise _StopForward

        return fn

    handles = [m.register_forward_pre_hook(hook(key)) for key, m in modules.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _capture_calls(
    modules: dict[str, nn.Module], calls: dict[str, list[LayerCall]], outputs: dict[str, list[torch.Tensor]], keep_chunks: int
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
                outputs[key].append(_first(out))
            seen[key] += 1

        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _group_modules(layer: nn.Module, arch: Architecture) -> dict[str, nn.Module]:
    """{first linear name of each group: that linear}; the group's linears share its input."""
    return {group[0]: get_submodule(layer, group[0]) for group in arch.groups}


def _group_of(arch: Architecture, name: str) -> str:
    for group in arch.groups:
        if name in group:
            return group[0]
    raise KeyError(name)


def _relative_error(Y_hat: list[torch.Tensor], Y: list[torch.Tensor]) -> float:
    num = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(Y_hat, Y))
    den = sum(float(b.double().pow(2).sum()) for b in Y)
    return (num / den) ** 0.5 if den > 0 else 0.0


# ---------------------------------------------------------------- solvers per layer


def _solve(W: torch.Tensor, stats: LayerStats | None, scheme: QuantScheme) -> QuantizedWeight:
    from infer_tool.packers.gptq import quantize_gptq
    from infer_tool.packers.rtn import quantize_rtn

    if isinstance(scheme, GPTQScheme):
        return quantize_gptq(W, stats, scheme)
    return quantize_rtn(W, stats, scheme)


def _record(
    result: PipelineResult, full: str, module: nn.Module, qw: QuantizedWeight, arch: Architecture, stats: LayerStats | None
) -> None:
    """Store the solver's result and replace the module's weight by its dequantized value."""
    W = weight_nk(module, arch.conv1d).detach().float()
    W_hat = qw.dequantize(torch.float32).to(W.device)
    if stats is not None and stats.H is not None:
        result.linear_errors[full] = relative_output_error(W, W_hat, stats.H.to(W.device))
    set_weight_nk(module, W_hat, arch.conv1d)
    qw.q, qw.scale = qw.q.cpu(), qw.scale.cpu()
    qw.zero = None if qw.zero is None else qw.zero.cpu()
    qw.g_idx = None if qw.g_idx is None else qw.g_idx.cpu()
    result.quantized[full] = qw
    if qw.info.get("fallback"):
        result.fallbacks.append({"layer": full, "fallback": qw.info["fallback"], "reason": qw.info.get("reason")})


@dataclass
class _ReplayPoint:
    """A sub-block of a decoder layer whose first output is its last linear's output."""

    parent: nn.Module  # e.g. self_attn, mlp
    linear: nn.Module  # e.g. o_proj, down_proj
    trailing: int | None  # None: the sub-block returns a tensor; else its tuple's length - 1


def _replay_points(
    layer: nn.Module, arch: Architecture, X: list[torch.Tensor], calls: list[LayerCall]
) -> tuple[list[torch.Tensor], dict[int, _ReplayPoint]]:
    """Run the layer on X (the error chunks) and find the groups that can be replayed.

    Group g qualifies when it is one linear inside a sub-block (not the layer itself), no
    later group lies in that sub-block, and on the first chunk the sub-block's (first)
    output equals that linear's output bit for bit. Returns (the layer outputs on X,
    {group index: replay point})."""
    candidates: dict[int, _ReplayPoint] = {}
    for g, group in enumerate(arch.groups):
        name = group[0]
        parent = name.rpartition(".")[0]
        later = [other[0].rpartition(".")[0] for other in arch.groups[g + 1 :]]
        if len(group) == 1 and parent and parent not in later:
            candidates[g] = _ReplayPoint(get_submodule(layer, parent), get_submodule(layer, name), None)
    seen: dict[tuple[int, str], Any] = {}
    handles = []
    for g, point in candidates.items():
        for role, module in (("parent", point.parent), ("linear", point.linear)):
            def hook(module: nn.Module, args: Any, out: Any, key: tuple[int, str] = (g, role)) -> None:
                seen.setdefault(key, out)

            handles.append(module.register_forward_hook(hook))
    try:
        Y = run_layer(layer, X[:1], calls[:1])
    finally:
        for h in handles:
            h.remove()
    points = {}
    for g, point in candidates.items():
        out, lin = seen.get((g, "parent")), seen.get((g, "linear"))
        if not isinstance(lin, torch.Tensor):
            continue
        if isinstance(out, torch.Tensor) and torch.equal(out, lin):
            points[g] = point
        elif isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) and torch.equal(out[0], lin):
            points[g] = _ReplayPoint(point.parent, point.linear, len(out) - 1)
    return Y + run_layer(layer, X[1:], calls[1:]), points


@contextlib.contextmanager
def _replay(point: _ReplayPoint, outputs: list[torch.Tensor]) -> Iterator[None]:
    """While active, the sub-block's forward returns its cached output, one chunk per
    call (its other outputs, attention weights, become None)."""
    chunks = iter(outputs)

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = next(chunks)
        return out if point.trailing is None else (out, *([None] * point.trailing))

    parent = point.parent
    saved = parent.__dict__.get("forward")  # an accelerate hook may have set one
    parent.forward = forward
    try:
        yield
    finally:
        if saved is None:
            del parent.forward
        else:
            parent.forward = saved


@contextlib.contextmanager
def _replaying(points: dict[int, _ReplayPoint], cached: dict[int, list[torch.Tensor]]) -> Iterator[None]:
    """Replay every sub-block whose output is cached (group index -> outputs per chunk)."""
    with contextlib.ExitStack() as stack:
        for g, outputs in cached.items():
            stack.enter_context(_replay(points[g], outputs))
        yield


def _gptq_layer(
    layer: nn.Module, prefix: str, X: list[torch.Tensor], calls: list[LayerCall], arch: Architecture,
    targets: set[str], scheme: GPTQScheme, result: PipelineResult, error_chunks: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """True-sequential GPTQ: each group's Hessian on inputs through the quantized earlier groups.

    Returns (Y, Ŷ): the fp outputs on the first `error_chunks` chunks and the quantized
    layer's outputs on all of X."""
    Y, points = _replay_points(layer, arch, X[:error_chunks], calls[:error_chunks])
    cached: dict[int, list[torch.Tensor]] = {}  # group index -> its quantized linear's outputs, per chunk
    for g, group in enumerate(arch.groups):
        todo = [n for n in group if f"{prefix}.{n}" in targets]
        if not todo:
            continue
        head = get_submodule(layer, group[0])
        acc = {group[0]: StatsAccumulator(weight_nk(head, arch.conv1d).shape[1], hessian=True)}
        keep: dict[str, list[torch.Tensor]] | None = {group[0]: []} if g in points else None
        with _replaying(points, cached), _capture_inputs({group[0]: head}, accs=acc, keep=keep, keep_chunks=len(X), stop=True):
            _run_until(layer, X, calls, head)
        stats = acc[group[0]].result()
        for n in group:
            result.stats[f"{prefix}.{n}"] = stats
        for n in todo:
            module = get_submodule(layer, n)
            qw = _solve(weight_nk(module, arch.conv1d).detach(), stats, scheme)
            _record(result, f"{prefix}.{n}", module, qw, arch, stats)
        if keep is not None:  # the sub-block's output is now final
            cached[g] = [points[g].linear(x) for x in keep.pop(group[0])]
    with _replaying(points, cached):
        Y_hat = run_layer(layer, X, calls)
    return Y, Y_hat


def _fold(smooth: nn.Module, balance: list[nn.Module], s: torch.Tensor, mapping: AWQMapping, arch: Architecture) -> None:
    """Divide `smooth`'s output channels (its `part` slice for a fused linear) by s and
    multiply the balance linears' input columns by s; the block's function is unchanged."""
    with torch.no_grad():
        s = s.to(balance[0].weight.device).float()
        K = s.numel()
        if isinstance(smooth, nn.Linear) or arch.conv1d and smooth.weight.dim() == 2:
            W = weight_nk(smooth, arch.conv1d).detach().float().clone()  # (N, K_in)
            i = mapping.part[0] if mapping.part else 0
            W[i * K : (i + 1) * K] /= s.view(-1, 1)
            set_weight_nk(smooth, W, arch.conv1d)
            if getattr(smooth, "bias", None) is not None:
                smooth.bias[i * K : (i + 1) * K] /= s.to(smooth.bias.dtype)
        else:
            w = smooth.weight
            w.copy_(((w.float() + arch.norm_offset) / s - arch.norm_offset).to(w.dtype))
            if getattr(smooth, "bias", None) is not None:
                smooth.bias.copy_((smooth.bias.float() / s).to(smooth.bias.dtype))
        for b in balance:
            set_weight_nk(b, weight_nk(b, arch.conv1d).float() * s.view(1, -1), arch.conv1d)


def _smooth_channels(smooth: nn.Module, arch: Architecture) -> int:
    if isinstance(smooth, nn.Linear) or arch.conv1d and smooth.weight.dim() == 2:
        return int(weight_nk(smooth, arch.conv1d).shape[0])
    return int(smooth.weight.numel())


def _awq_layer(
    layer: nn.Module, prefix: str, X: list[torch.Tensor], calls: list[LayerCall], arch: Architecture,
    targets: set[str], scheme: AWQScheme, result: PipelineResult, search_chunks: int,
) -> list[torch.Tensor]:
    """AWQ on one block; returns the fp block outputs Y (measured before any change)."""
    from infer_tool.packers.awq import apply_awq_clip, awq_search_clip, awq_search_scale
    from infer_tool.packers.rtn import quantize_rtn

    heads = _group_modules(layer, arch)
    accs = {k: StatsAccumulator(weight_nk(m, arch.conv1d).shape[1], hessian=False) for k, m in heads.items()}
    keep: dict[str, list[torch.Tensor]] = {k: [] for k in heads}
    inspect = {m.inspect: get_submodule(layer, m.inspect) for m in arch.mappings}
    icalls: dict[str, list[LayerCall]] = {k: [] for k in inspect}
    iouts: dict[str, list[torch.Tensor]] = {k: [] for k in inspect}
    with _capture_inputs(heads, accs=accs, keep=keep, keep_chunks=search_chunks), _capture_calls(
        inspect, icalls, iouts, search_chunks
    ):
        Y = run_layer(layer, X, calls)
    stats = {k: a.result() for k, a in accs.items()}
    for group in arch.groups:
        for n in group:
            result.stats[f"{prefix}.{n}"] = stats[group[0]]
    x_sub = {k: torch.cat([x.reshape(-1, x.shape[-1]) for x in v]) for k, v in keep.items()}  # (t, K) per group

    # 1. scale search for every mapping on the fp block, then fold them all (as AutoAWQ).
    found: list[tuple[AWQMapping, torch.Tensor]] = []
    for m in arch.mappings:
        entry: dict[str, Any] = {"layer": prefix, "smooth": m.smooth, "balance": list(m.balance)}
        result.awq.append(entry)
        if any(f"{prefix}.{b}" not in targets for b in m.balance):
            entry["skipped"] = "a balance layer is not quantized (--ignore)"
            continue
        smooth = get_submodule(layer, m.smooth)
        balance = [get_submodule(layer, b) for b in m.balance]
        K = int(weight_nk(balance[0], arch.conv1d).shape[1])
        need = K * (m.part[1] if m.part else 1)
        if _smooth_channels(smooth, arch) != need:
            entry["skipped"] = f"{m.smooth} has {_smooth_channels(smooth, arch)} outputs, {m.balance[0]} reads {K} (GQA)"
            continue
        originals = [weight_nk(b, arch.conv1d).detach().clone() for b in balance]
        module = inspect[m.inspect]

        def forward(effective: list[torch.Tensor], balance: list[nn.Module] = balance, module: nn.Module = module, key: str = m.inspect) -> torch.Tensor:
            for b, w in zip(balance, effective):
                set_weight_nk(b, w, arch.conv1d)
            with torch.no_grad():
                return torch.cat([_first(module(*c.args, **c.kwargs)) for c in icalls[key]])

        gram = None
        if m.balance == (m.inspect,):  # the block is the linear: its output MSE from XᵀX
            T = sum(c.args[0].numel() // K for c in icalls[m.inspect])
            N, n = sum(int(o.shape[0]) for o in originals), scheme.grid + 1
            if n * T * N * K > n * N * K * K + T * K * K:  # flops: running X·Wᵀ vs forming XᵀX once
                x = torch.cat([c.args[0].reshape(-1, K) for c in icalls[m.inspect]]).float()
                gram = (x.T @ x, T)
        try:
            found_scale = awq_search_scale(
                stats[_group_of(arch, m.balance[0])].act_abs_mean.to(originals[0].device),
                originals, forward, None if gram else torch.cat(iouts[m.inspect]), scheme, gram=gram,
            )
        finally:
            for b, w in zip(balance, originals):
                set_weight_nk(b, w, arch.conv1d)
        entry.update(ratio=found_scale.ratio, loss=found_scale.best_loss, rtn_loss=found_scale.rtn_loss)
        found.append((m, found_scale.scales))
    for m, s in found:
        _fold(get_submodule(layer, m.smooth), [get_submodule(layer, b) for b in m.balance], s, m, arch)
        key = _group_of(arch, m.balance[0])
        x_sub[key] = x_sub[key] / s.to(x_sub[key].device).view(1, -1)

    # 2. clip search, then RTN of the scaled, clipped weight.
    for group in arch.groups:
        for n in group:
            full = f"{prefix}.{n}"
            if full not in targets:
                continue
            module = get_submodule(layer, n)
            W = weight_nk(module, arch.conv1d).detach().float()
            if scheme.clip and n not in arch.no_clip:
                W = apply_awq_clip(W, awq_search_clip(W, x_sub[group[0]], scheme))
            _record(result, full, module, quantize_rtn(W, None, scheme), arch, None)
    return Y


# ---------------------------------------------------------------- entry points


def _data_free(scheme: QuantScheme) -> bool:
    """True when the solver reads no calibration activations (RTN; FP8 with dynamic
    activations, no clip search and no KV-cache scales)."""
    if getattr(scheme, "method", None) == "fp8":
        return not (scheme.needs_activation_stats or scheme.needs_hessian or scheme.kv_cache == "fp8")
    return not isinstance(scheme, (GPTQScheme, AWQScheme))


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    input_ids: torch.Tensor,
    scheme: QuantScheme | None,
    *,
    ignore: tuple[str, ...] = (),
    device: str | torch.device | None = None,
    batch_size: int | None = None,
    search_samples: int = AWQ_SEARCH_SAMPLES,
    progress: Progress | None = None,
) -> PipelineResult:
    """Quantize `model`'s decoder linears in place (their weights become the dequantized
    values, AWQ scales folded) layer by layer on `input_ids` (B, T) calibration tokens.

    scheme None: measure every linear's statistics (with Hessians) on the fp model and
    quantize nothing (`calibrate`). Returns the per-linear `QuantizedWeight`s, statistics,
    per-layer relative output errors, fallbacks, AWQ search results and stage timings.
    batch_size: sequences per layer forward; None: BATCH_SIZE, or CPU_BATCH_TOKENS' worth on a CPU.
    """
    dev = _device(device)
    if batch_size is None:
        batch_size = max(1, CPU_BATCH_TOKENS // input_ids.shape[1]) if dev.type == "cpu" else BATCH_SIZE
    # Subnormal floats (tiny activations times tiny weights) slow CPU matmuls ~30x.
    flush = torch.set_flush_denormal(True)
    try:
        return _quantize_model(model, input_ids, scheme, ignore, dev, batch_size, search_samples, progress or no_progress)
    finally:
        if flush:
            torch.set_flush_denormal(False)


def _quantize_model(
    model: nn.Module, input_ids: torch.Tensor, scheme: QuantScheme | None, ignore: tuple[str, ...],
    dev: torch.device, batch_size: int, search_samples: int, progress: Progress,
) -> PipelineResult:
    t0 = time.perf_counter()
    arch, names = plan(model, scheme, ignore)
    targets = set(names) if scheme is not None else set()
    result = PipelineResult(ignored=sorted(set(linear_shapes(model, arch)) - set(names)), tokens=int(input_ids.numel()))
    model.eval()
    chunks = lambda samples: max(1, -(-samples // batch_size))  # noqa: E731
    search_chunks, error_chunks = chunks(search_samples), chunks(ERROR_SAMPLES)
    if scheme is not None and _data_free(scheme):
        # The solver reads no activations: run only what the reported error needs.
        input_ids = input_ids[: error_chunks * batch_size]
        result.tokens = int(input_ids.numel())
    X, calls = capture_inputs(model, arch, input_ids, batch_size, dev)
    result.seconds["capture"] = time.perf_counter() - t0
    layers = decoder_layers(model, arch)
    t_layers = time.perf_counter()
    home = next(layers[0].parameters()).device
    for i, layer in enumerate(layers):
        prefix = f"{arch.layers}.{i}"
        layer.to(dev)
        if scheme is None:
            heads = _group_modules(layer, arch)
            accs = {k: StatsAccumulator(weight_nk(m, arch.conv1d).shape[1], hessian=True) for k, m in heads.items()}
            with _capture_inputs(heads, accs=accs):
                Y = run_layer(layer, X, calls[i])
            for group in arch.groups:
                st = accs[group[0]].result()
                for n in group:
                    result.stats[f"{prefix}.{n}"] = st
            Y_hat = Y
        else:
            if isinstance(scheme, AWQScheme):
                Y = _awq_layer(layer, prefix, X, calls[i], arch, targets, scheme, result, search_chunks)[:error_chunks]
                Y_hat = run_layer(layer, X, calls[i])
            elif isinstance(scheme, GPTQScheme):
                Y, Y_hat = _gptq_layer(layer, prefix, X, calls[i], arch, targets, scheme, result, error_chunks)
            else:
                Y = run_layer(layer, X[:error_chunks], calls[i][:error_chunks])  # fp outputs, for the error only
                if getattr(scheme, "method", None) == "fp8":
                    from infer_tool.calib.fp8_layers import fp8_layer

                    fp8_layer(layer, prefix, X, calls[i], arch, targets, scheme, result)
                else:
                    for n in arch.linears:
                        if f"{prefix}.{n}" in targets:
                            module = get_submodule(layer, n)
                            _record(result, f"{prefix}.{n}", module, _solve(weight_nk(module, arch.conv1d).detach(), None, scheme), arch, None)
                Y_hat = run_layer(layer, X, calls[i])
        err = _relative_error(Y_hat[: len(Y)], Y)
        result.layer_errors.append({"layer": prefix, "relative_output_error": err})
        del Y
        X = Y_hat
        layer.to(home)
        progress("quantize" if scheme is not None else "calibrate", i + 1, len(layers), rel_err=err)
    result.seconds["layers"] = time.perf_counter() - t_layers
    result.seconds["total"] = time.perf_counter() - t0
    return result


@torch.no_grad()
def quantize_from_stats(
    model: nn.Module,
    stats: dict[str, LayerStats],
    scheme: QuantScheme,
    *,
    ignore: tuple[str, ...] = (),
    device: str | torch.device | None = None,
    progress: Progress | None = None,
) -> PipelineResult:
    """Quantize with saved statistics (`quantize --stats`): no forward pass at all.

    Every Hessian was measured on the fp model, so GPTQ no longer sees the quantization
    error of earlier layers and earlier groups (true-sequential is lost); AWQ needs block
    outputs on live activations and is refused."""
    progress = progress or no_progress
    if isinstance(scheme, AWQScheme):
        raise BadInput("--stats works with --method gptq or rtn: AWQ's scale search needs block outputs on live activations")
    dev = _device(device)
    t0 = time.perf_counter()
    arch, names = plan(model, scheme, ignore)
    missing = [n for n in names if n not in stats]
    if missing:
        raise BadInput(f"the statistics lack {len(missing)} layers (first: {missing[0]}); they were made for another model")
    result = PipelineResult(ignored=sorted(set(linear_shapes(model, arch)) - set(names)))
    result.tokens = max((s.tokens for s in stats.values()), default=0)
    layers = decoder_layers(model, arch)
    targets = set(names)
    for i, layer in enumerate(layers):
        prefix = f"{arch.layers}.{i}"
        home = next(layer.parameters()).device
        layer.to(dev)
        for n in arch.linears:
            full = f"{prefix}.{n}"
            if full in targets:
                module = get_submodule(layer, n)
                st = stats[full]
                if st.H is not None:
                    st = LayerStats(st.H.to(dev), st.act_abs_mean.to(dev), st.act_abs_max, st.tokens)
                result.stats[full] = stats[full]
                if getattr(scheme, "method", None) == "fp8":
                    from infer_tool.calib.fp8_layers import quantize_linear_fp8

                    quantize_linear_fp8(result, full, module, arch, st, scheme)
                    continue
                _record(result, full, module, _solve(weight_nk(module, arch.conv1d).detach(), st, scheme), arch, st)
        layer.to(home)
        progress("quantize", i + 1, len(layers))
    result.seconds["layers"] = result.seconds["total"] = time.perf_counter() - t0
    return result
