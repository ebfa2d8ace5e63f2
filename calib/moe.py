"""Mixture-of-experts layers in the calibration pipeline: per-expert linears, the two
calibration modes, the routing seen on calibration tokens.

- `unfuse_experts`: transformers 5 stores an MoE block's experts as two 3-D parameters,
  `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I). They are replaced by `MoeExperts`,
  one `ExpertMLP` per expert whose gate/up/down are `nn.Linear` on 2-D views of the same
  storage (no copy), named `{experts}.{j}.gate_proj` as in the original checkpoint. Every
  linear-level mechanism (hooks, solvers, `record`, the writers) then applies per expert.
- Calibration modes (`MoeCalibration.mode`):
  - "all": every expert computes on every token while statistics are measured, but the
    block output still combines only the routed experts (`all_tokens`), so the next layer
    sees the model's real activations; no expert is ever left without data.
  - "routed": each expert sees only the tokens routed to it; an expert with fewer than
    `min_tokens` falls back to RTN (GPTQ, AWQ) and the report names it.
- `capturing_routing`: the experts' inputs (the block's normed input, flattened) and the
  router's choice per token, kept per chunk, and the routed token count per expert.
- What every method does per expert: `MoeLayer.order` (the shared expert first, then each
  expert) and `run_until_down` (an expert's down_proj inputs on its rows).

Memory: a layer keeps its block input (tokens × H) once; each expert's rows are selected
from it when that expert is processed, and its statistics are freed after its solve.

This module knows no quantization method and no file format.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from infer_tool.calib.architectures import EXPERT_PROJECTIONS, Architecture, MoE, get_submodule
from infer_tool.calib.distributed import all_sum, chunks
from infer_tool.calib.layers import StopForward, capturing_inputs, decoder_layers
from infer_tool.calib.stats import StatsAccumulator
from infer_tool.common.errors import BadInput

MOE_MODES = ("all", "routed")


@dataclass(frozen=True)
class MoeCalibration:
    """How experts are calibrated. mode: "all" or "routed" (see the module docstring);
    min_tokens: in "routed" mode, an expert routed fewer calibration tokens is RTN-quantized
    (and named in the report); in both modes the report lists the experts below it."""

    mode: str = "all"
    min_tokens: int = 128

    def __post_init__(self) -> None:
        if self.mode not in MOE_MODES:
            raise BadInput(f"--moe-calibration {self.mode!r} is not supported; use one of {', '.join(MOE_MODES)}")
        if self.min_tokens < 0:
            raise BadInput(f"--moe-min-tokens {self.min_tokens} must be >= 0")


class ExpertMLP(nn.Module):
    """One expert: down_proj(act(gate_proj(x)) · up_proj(x)), x (t, H) -> (t, H)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act_fn: nn.Module) -> None:
        super().__init__()
        for name, w in zip(EXPERT_PROJECTIONS, (gate, up, down)):
            linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            linear.weight = nn.Parameter(w, requires_grad=False)
            self.add_module(name, linear)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MoeExperts(nn.ModuleList):
    """The experts of one MoE block, called as transformers' fused experts are:
    forward(hidden_states (t, H), top_k_index (t, k), top_k_weights (t, k)) -> (t, H), the
    sum over each token's k experts of weight · expert(x).

    `all_tokens` (calibration): every expert runs on all t tokens, so hooks on its linears
    see them all; the output still combines only the routed experts."""

    all_tokens: bool = False

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for j, expert in enumerate(self):
            rows, slot = torch.where(top_k_index == j)  # (n,), (n,)
            if self.all_tokens:
                y = expert(hidden_states)[rows]
            elif rows.numel():
                y = expert(hidden_states[rows])
            else:
                continue
            # rows are distinct within one expert: one addition per row, as index_add_ (slower on CPU)
            out.index_put_((rows,), (y * top_k_weights[rows, slot, None]).to(out.dtype), accumulate=True)
        return out


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


@torch.no_grad()
def unfuse_experts(model: nn.Module, arch: Architecture) -> int:
    """Replace every MoE layer's fused experts by `MoeExperts` (views of the same storage).
    Idempotent. Returns the number of MoE layers."""
    if arch.moe is None:
        return 0
    count = 0
    for i, layer in enumerate(decoder_layers(model, arch)):
        if not arch.experts_in(layer):
            continue
        count += 1
        fused = get_submodule(layer, arch.moe.experts)
        if isinstance(fused, MoeExperts):
            continue
        gate_up, down = getattr(fused, "gate_up_proj", None), getattr(fused, "down_proj", None)
        E = arch.experts_in(layer)
        ok = isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == down.dim() == 3
        if ok:
            _, two_i, H = gate_up.shape
            ok = two_i % 2 == 0 and tuple(down.shape) == (E, H, two_i // 2) and not getattr(fused, "has_bias", False)
        if not ok or not hasattr(fused, "act_fn"):
            raise BadInput(
                f"{arch.layers}.{i}.{arch.moe.experts} ({type(fused).__name__}) is not transformers' fused experts "
                "layout gate_up_proj (E, 2I, H) + down_proj (E, H, I) without bias, which the MoE entries describe"
            )
        inter = two_i // 2
        experts = MoeExperts(
            ExpertMLP(gate_up.data[j, :inter], gate_up.data[j, inter:], down.data[j], fused.act_fn) for j in range(E)
        )
        _set_submodule(layer, arch.moe.experts, experts)
    return count


@dataclass
class MoeLayer:
    """One decoder layer's MoE block, as the quantizers see it (names relative to the layer)."""

    spec: MoE
    block: nn.Module  # the sparse MoE block; its output is what AWQ's norm -> experts search scores
    experts: MoeExperts
    smooth: str | None  # the norm the block reads (AWQ's smooth module), from the dense mappings
    calibration: MoeCalibration

    def __len__(self) -> int:
        return len(self.experts)

    def expert(self, j: int | None) -> tuple[str, str, str]:
        """(gate, up, down) names of expert j; None: of the shared expert."""
        if j is None:
            if self.shared is None:
                raise ValueError(f"{self.spec.block} has no shared expert")
            return self.shared
        return tuple(f"{self.spec.experts}.{j}.{p}" for p in EXPERT_PROJECTIONS)  # type: ignore[return-value]

    def module_name(self, j: int | None) -> str:
        """The name of expert j's module (None: the shared expert's), relative to the layer."""
        return self.expert(j)[2].rpartition(".")[0]

    def order(self) -> list[int | None]:
        """The experts in the order the quantizers handle them: the shared expert (None) first,
        if there is one, then 0 .. E-1."""
        return ([None] if self.spec.shared else []) + list(range(len(self)))

    @property
    def shared(self) -> tuple[str, str, str] | None:
        """(gate, up, down) names of the shared expert, if any."""
        return tuple(f"{self.spec.shared}.{p}" for p in EXPERT_PROJECTIONS) if self.spec.shared else None  # type: ignore[return-value]

    @property
    def unquantized(self) -> tuple[str, ...]:
        """The router and the shared expert's gate: read the block input, never quantized."""
        return (self.spec.router,) + ((self.spec.shared_gate,) if self.spec.shared_gate else ())


def moe_layer(layer: nn.Module, arch: Architecture, calibration: MoeCalibration) -> MoeLayer | None:
    """The MoE block of `layer` (after `unfuse_experts`), or None for a dense layer."""
    if not arch.experts_in(layer):
        return None
    experts = get_submodule(layer, arch.moe.experts)
    if not isinstance(experts, MoeExperts):
        raise ValueError(f"{arch.moe.experts}: call unfuse_experts first")
    inside = f"{arch.moe.block}."
    smooth = next(
        (m.smooth for m in arch.mappings if m.balance[0].startswith(inside) and not m.smooth.startswith(inside)), None
    )
    return MoeLayer(arch.moe, get_submodule(layer, arch.moe.block), experts, smooth, calibration)


@contextlib.contextmanager
def all_tokens(moe: MoeLayer | None, on: bool = True) -> Iterator[None]:
    """While active (and `on`), every expert of `moe` computes on every token."""
    if moe is None or not on:
        yield
        return
    moe.experts.all_tokens = True
    try:
        yield
    finally:
        moe.experts.all_tokens = False


@dataclass
class Routing:
    """What the experts of one block were called with, per chunk: x (t, H) the block's
    (normed, flattened) input, index (t, k) the chosen experts, weight (t, k) their weights;
    counts (E,) int64 the tokens routed to each expert over every call, and `total` the tokens
    of every call (both over every process once the capture has ended)."""

    counts: torch.Tensor
    total: int = 0
    x: list[torch.Tensor] = field(default_factory=list)
    index: list[torch.Tensor] = field(default_factory=list)
    weight: list[torch.Tensor] = field(default_factory=list)

    def rows(self, j: int, mode: str) -> list[torch.Tensor]:
        """Expert j's input rows per chunk: all of them ("all") or its routed ones."""
        if mode == "all":
            return self.x
        return [x[(idx == j).any(-1)] for x, idx in zip(self.x, self.index)]

    def tokens(self, j: int, mode: str) -> int:
        """The calibration tokens expert j computes on in `mode`."""
        return self.total if mode == "all" else int(self.counts[j])


@contextlib.contextmanager
def capturing_routing(moe: MoeLayer, keep_chunks: int = 0, stop: bool = False) -> Iterator[Routing]:
    """A pre-hook on the experts: count the tokens routed to each expert on every call and
    keep the first `keep_chunks` calls' (x, index, weight); with `stop`, end the forward there."""
    routing = Routing(torch.zeros(len(moe), dtype=torch.int64))
    seen = [0]

    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        x, index, weight = args[:3]
        routing.counts += torch.bincount(index.reshape(-1).cpu(), minlength=len(moe))[: len(moe)]
        routing.total += int(x.shape[0])
        if seen[0] < keep_chunks:
            routing.x.append(x)
            routing.index.append(index)
            routing.weight.append(weight)
        seen[0] += 1
        if stop:
            raise StopForward

    handle = moe.experts.register_forward_pre_hook(hook)
    try:
        yield routing
    finally:
        handle.remove()
    summed = all_sum(torch.cat([routing.counts, torch.tensor([routing.total])]))
    routing.counts, routing.total = summed[:-1], int(summed[-1])


def run_until_down(
    expert: nn.Module,
    rows: Sequence[torch.Tensor],
    *,
    acc: StatsAccumulator | None = None,
    keep: list[torch.Tensor] | None = None,
) -> None:
    """Run `expert` (gate_proj, up_proj, down_proj) on each of this process's chunks `rows`
    (t, H) up to its down_proj, and stop there: each down_proj input (t, I) is added to `acc`
    and appended to `keep` (either may be None)."""
    with capturing_inputs(
        {"down": expert.down_proj},
        accs=None if acc is None else {"down": acc},
        keep=None if keep is None else {"down": keep},
        keep_chunks=len(rows),
        stop=True,
    ):
        for x in chunks(rows):
            try:
                expert(x)
            except StopForward:
                pass


@dataclass
class ExpertTokens:
    """Routed calibration tokens per expert of one MoE layer (each token counts once per
    expert it is routed to), and the experts below the threshold."""

    layer: str
    tokens: int  # tokens through the block
    counts: list[int]
    min: int
    median: float
    max: int
    below: list[int]  # experts routed fewer than `threshold` tokens
    threshold: int

    @classmethod
    def of(cls, layer: str, counts: torch.Tensor, tokens: int, threshold: int) -> ExpertTokens:
        c = counts.tolist()
        return cls(
            layer,
            tokens,
            c,
            min(c),
            float(counts.double().median()),
            max(c),
            [j for j, n in enumerate(c) if n < threshold],
            threshold,
        )


def routers(model: nn.Module, arch: Architecture) -> list[str]:
    """Full names of every MoE layer's router (and shared-expert gate): never quantized."""
    if arch.moe is None:
        return []
    extra = (arch.moe.router,) + ((arch.moe.shared_gate,) if arch.moe.shared_gate else ())
    return [
        f"{arch.layers}.{i}.{n}"
        for i, layer in enumerate(decoder_layers(model, arch))
        if arch.experts_in(layer)
        for n in extra
    ]
