"""Replay of final sub-blocks: once a sub-block's last linear is quantized, its output
is final, so later runs of the layer return it from cache instead of recomputing it.

A sub-block (attention -> o_proj, MLP -> down_proj) qualifies when its (first) output is
its last linear's output bit for bit (checked on the first chunk, `replay_points`). GPTQ's
true-sequential groups then run attention once per layer, not once per group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from infer_tool.calib.architectures import Architecture, get_submodule
from infer_tool.calib.layers import LayerCall, run_layer


@dataclass
class ReplayPoint:
    """A sub-block of a decoder layer whose first output is its last linear's output."""

    parent: nn.Module  # e.g. self_attn, mlp
    linear: nn.Module  # e.g. o_proj, down_proj
    trailing: int | None  # None: the sub-block returns a tensor; else its tuple's length - 1


def replay_points(
    layer: nn.Module, arch: Architecture, X: list[torch.Tensor], calls: list[LayerCall]
) -> tuple[list[torch.Tensor], dict[int, ReplayPoint]]:
    """Run the layer on X (the error chunks) and find the groups that can be replayed.

    Group g qualifies when it is one linear inside a sub-block (not the layer itself), no
    later group lies in that sub-block, and on the first chunk the sub-block's (first)
    output equals that linear's output bit for bit. Returns (the layer outputs on X,
    {group index: replay point})."""
    candidates: dict[int, ReplayPoint] = {}
    for g, group in enumerate(arch.groups):
        name = group[0]
        parent = name.rpartition(".")[0]
        later = [other[0].rpartition(".")[0] for other in arch.groups[g + 1 :]]
        if len(group) == 1 and parent and parent not in later:
            candidates[g] = ReplayPoint(get_submodule(layer, parent), get_submodule(layer, name), None)
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
            points[g] = ReplayPoint(point.parent, point.linear, len(out) - 1)
    return Y + run_layer(layer, X[1:], calls[1:], start=1), points


@contextlib.contextmanager
def _replay(point: ReplayPoint, outputs: list[torch.Tensor]) -> Iterator[None]:
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
def replaying(points: dict[int, ReplayPoint], cached: dict[int, list[torch.Tensor]]) -> Iterator[None]:
    """Replay every sub-block whose output is cached (group index -> outputs per chunk)."""
    with contextlib.ExitStack() as stack:
        for g, outputs in cached.items():
            stack.enter_context(_replay(points[g], outputs))
        yield
