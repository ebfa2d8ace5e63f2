"""The sensitivity pass of a mixed-precision plan: for every linear group and candidate, the
predicted increase of the KL divergence of the model's next-token distribution from the
unquantized model's when only that group is quantized with that candidate (RTN, or GPTQ with
each linear's H from the unquantized model's inputs: `collect_stats`).

Groups are the units vLLM requires to share one scheme (`linear_groups`): the shards it fuses
into one linear (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`: its compressed-tensors
loader takes the first shard's scheme for all of them, and refuses a fused linear only some
of whose shards are ignored), every other linear alone.

Estimator (second order; the first-order term of the KL vanishes at the reference). For a
weight change δ, KL(P ‖ P_δ) ≈ ½ δᵀ F δ with F the Fisher information of the model's own
distribution, F = E_{y~P}[∇log p(y) ∇log p(y)ᵀ]. Labels y are sampled from the model at
every position of a calibration window, one backward pass gives G = ∂ Σ_t log p(y_t) / ∂Y,
the gradient at each linear's output Y (T, N), and the group's output change is
ΔY = X ΔWᵀ (X the linear's input in the same pass). The estimates per (group, candidate), in
nats per token (summed over windows, divided by their tokens):
- `sampled`: ½ (Σ G ⊙ ΔY)² per window, a single-sample unbiased estimate of δᵀFδ under linearisation
  (cross-position terms vanish in expectation because each y_t is drawn from the model);
- `diagonal`: ½ Σ G² ⊙ ΔY², the same with the Fisher taken diagonal in the outputs (what
  ModelOpt's AutoQuantize scores with): biased, lower variance;
- `scaled`: `diagonal` times one factor, Σ sampled / Σ diagonal over every (group, candidate):
  the diagonal's ranking (low variance) at the unbiased estimate's overall scale.
A plan adds groups' costs: interactions between groups are ignored (measured in the notes).

What this module does not know: how the KL is evaluated, or how a plan is written.
MoE layers are refused (their experts share one scheme per layer in vLLM; not built yet).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from infer_tool.calib.architectures import Architecture, get_submodule
from infer_tool.calib.layers import set_weight_nk, weight_nk
from infer_tool.calib.mixed_candidates import Candidate
from infer_tool.calib.stats import LayerStats
from infer_tool.common.errors import BadInput
from infer_tool.common.progress import Progress, no_progress

ESTIMATORS = ("scaled", "diagonal", "sampled")
# vLLM's packed_modules_mapping for Llama-like models: the shards of one fused linear
FUSED_SHARDS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@dataclass(frozen=True)
class LinearGroup:
    """Linears that take one scheme: `name` (the fused name vLLM loads, or the linear's),
    `linears` full module names, `shapes` their (N, K)."""

    name: str
    linears: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...]

    @property
    def weights(self) -> int:
        return sum(n * k for n, k in self.shapes)


def linear_groups(model: nn.Module, arch: Architecture) -> list[LinearGroup]:
    """The model's decoder linears as vLLM's scheme units, layer by layer, in processing order."""
    layers = get_submodule(model, arch.layers)
    out = []
    for i, layer in enumerate(layers):
        if arch.experts_in(layer):
            raise BadInput(
                f"{arch.layers}.{i} is a mixture of experts: mixed-precision planning of MoE layers is not built yet "
                "(vLLM needs every expert's gate, up and down projections of a layer to share one scheme)"
            )
        names = list(arch.for_layer(layer).linears)
        taken: set[str] = set()
        for n in names:
            if n in taken:
                continue
            parent, _, leaf = n.rpartition(".")
            members = (n,)
            name = n
            for fused, shards in FUSED_SHARDS.items():
                siblings = tuple(f"{parent}.{s}" if parent else s for s in shards)
                if leaf == shards[0] and all(s in names for s in siblings):
                    members, name = siblings, f"{parent}.{fused}" if parent else fused
            taken.update(members)
            shapes = tuple(tuple(weight_nk(layer.get_submodule(m), arch.conv1d).shape) for m in members)
            prefix = f"{arch.layers}.{i}"
            out.append(LinearGroup(f"{prefix}.{name}", tuple(f"{prefix}.{m}" for m in members), shapes))  # type: ignore[arg-type]
    return out


def fits(candidate: Candidate, group: LinearGroup) -> bool:
    """Whether the candidate's scheme takes every linear of the group (its group size divides K, ...)."""
    if candidate.scheme is None:
        return True
    try:
        candidate.scheme.check_shapes(dict(zip(group.linears, group.shapes)))
    except BadInput:
        return False
    return True


def solved(
    candidate: Candidate,
    weights: Sequence[torch.Tensor],
    names: Sequence[str],
    stats: Mapping[str, LayerStats] | None = None,
) -> list[Any]:
    """The group's weights (each (N_i, K)) solved by the candidate's solver: the weight objects
    its codec writes (for RTN, what a uniform run of the scheme writes for these linears). FP4
    shards share one global scale, as vLLM keeps one per fused linear. A solver that reads
    statistics (GPTQ) gets each linear's `stats` (`collect_stats`: the fp model's inputs)."""
    from infer_tool.calib.quantizers import quantizer_for

    scheme = candidate.scheme
    q = quantizer_for(scheme)
    ws = [w.float() for w in weights]
    if not q.needs(scheme).data_free:
        if q.shares_fused(scheme):  # refused by jobs/mixed_plan.check_options before any work
            raise ValueError(f"{candidate.name} ({scheme.method}): fused shards sharing a scale need the pipeline")
        if stats is None:
            raise ValueError(f"{candidate.name} ({scheme.method}) needs calibration statistics")
        return [q.solve(w, stats[n], scheme, n) for w, n in zip(ws, names)]
    shared = q.fused_share(ws, scheme) if q.shares_fused(scheme) else None  # NVFP4: one global scale
    return [q.solve_data_free(w, scheme, n, shared) for w, n in zip(ws, names)]


def dequantized(
    candidate: Candidate,
    weights: Sequence[torch.Tensor],
    names: Sequence[str],
    stats: Mapping[str, LayerStats] | None = None,
) -> list[torch.Tensor]:
    """The group's weights (each (N_i, K)) as the candidate's solver leaves them, float32."""
    if candidate.scheme is None:
        return [w.float() for w in weights]
    return [w.dequantize(torch.float32) for w in solved(candidate, weights, names, stats)]


def needs_stats(candidates: Sequence[Candidate]) -> bool:
    """Whether a candidate's solver reads calibration statistics (GPTQ's Hessian)."""
    from infer_tool.calib.quantizers import quantizer_for

    return any(c.scheme is not None and not quantizer_for(c.scheme).needs(c.scheme).data_free for c in candidates)


@torch.no_grad()
def collect_stats(model: nn.Module, names: Sequence[str], batch: torch.Tensor) -> dict[str, LayerStats]:
    """{linear: statistics of its input (H = 2XXᵀ/T, ...)} over `batch` (B, T) run through the
    unquantized model (not layer by layer after quantized ones, as a uniform run's pipeline does:
    the statistics `calibrate` saves)."""
    from infer_tool.calib.stats import StatsAccumulator

    acc = {n: StatsAccumulator(model.get_submodule(n).in_features) for n in names}
    handles = [
        model.get_submodule(n).register_forward_hook(lambda m, args, out, n=n: acc[n].add(args[0])) for n in names
    ]
    device = next(model.parameters()).device
    try:
        for s in range(batch.shape[0]):
            model(batch[s : s + 1].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {n: a.result() for n, a in acc.items()}


def plan_weights(
    model: nn.Module, arch: Architecture, groups: Sequence[LinearGroup], chosen: Mapping[str, Candidate]
) -> dict[str, torch.Tensor]:
    """{linear name: dequantized (N, K) weight} for the groups named in `chosen` ({group name: candidate})."""
    out = {}
    for g in groups:
        if g.name not in chosen:
            continue
        ws = [weight_nk(model.get_submodule(n), arch.conv1d).detach() for n in g.linears]
        out.update(zip(g.linears, dequantized(chosen[g.name], ws, g.linears)))
    return out


@contextlib.contextmanager
def weights_replaced(model: nn.Module, arch: Architecture, weights: Mapping[str, torch.Tensor]) -> Iterator[nn.Module]:
    """The model with the linears named in `weights` holding those (N, K) weights; restored on exit."""
    saved = {}
    try:
        for name, W in weights.items():
            module = model.get_submodule(name)
            saved[name] = weight_nk(module, arch.conv1d).detach().clone()
            set_weight_nk(module, W.to(module.weight.dtype), arch.conv1d)
        yield model
    finally:
        for name, W in saved.items():
            set_weight_nk(model.get_submodule(name), W, arch.conv1d)


@dataclass
class Sensitivity:
    """Predicted KL increase (nats per token) of each group (rows, `groups` order) under each
    candidate (columns); None where the candidate does not take the group."""

    groups: list[LinearGroup]
    candidates: list[Candidate]
    sampled: list[list[float | None]]
    diagonal: list[list[float | None]]
    tokens: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    def costs(self, estimator: str) -> list[list[float | None]]:
        if estimator not in ESTIMATORS:
            raise BadInput(f"estimator {estimator!r}: use one of {', '.join(ESTIMATORS)}")
        if estimator != "scaled":
            return self.sampled if estimator == "sampled" else self.diagonal
        total = sum(v for row in self.diagonal for v in row if v)
        factor = sum(v for row in self.sampled for v in row if v) / total if total else 1.0
        return [[None if v is None else v * factor for v in row] for row in self.diagonal]


@contextlib.contextmanager
def _capturing(model: nn.Module, names: Sequence[str]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """({linear: input X (B, T, K)}, {linear: dL/dY (B, T, N)}) filled by the next forward and backward."""
    inputs: dict[str, Any] = {}
    grads: dict[str, Any] = {}
    handles = []

    def hook(name: str) -> Any:
        def fwd(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            inputs[name] = args[0].detach()

            def keep(g: torch.Tensor) -> None:
                grads[name] = g.detach()

            output.register_hook(keep)

        return fwd

    try:
        for n in names:
            handles.append(model.get_submodule(n).register_forward_hook(hook(n)))
        yield inputs, grads
    finally:
        for h in handles:
            h.remove()


def measure_sensitivity(
    model: nn.Module,
    arch: Architecture,
    groups: Sequence[LinearGroup],
    candidates: Sequence[Candidate],
    batch: torch.Tensor,
    *,
    seed: int = 0,
    progress: Progress | None = None,
    stats: Mapping[str, LayerStats] | None = None,
) -> Sensitivity:
    """Both estimates (module docstring) over `batch` (B, T) token windows, one sequence at a
    time; the model is left as it was (weights, requires_grad)."""
    progress = progress or no_progress
    t0 = time.perf_counter()
    G, C = len(groups), len(candidates)
    ok = [[fits(c, g) for c in candidates] for g in groups]
    sampled = [[0.0] * C for _ in range(G)]
    diagonal = [[0.0] * C for _ in range(G)]
    # per group and linear, the weight changes of the candidates that take the group stacked
    # (C_g · N, K) in bfloat16 (halves the memory): one matmul per linear and window for all of them
    taken = [[ci for ci, c in enumerate(candidates) if ok[gi][ci] and c.scheme is not None] for gi in range(G)]
    stacked: list[list[torch.Tensor | None]] = []
    for gi, g in enumerate(groups):
        ws = [weight_nk(model.get_submodule(n), arch.conv1d).detach().float() for n in g.linears]
        per_candidate = [
            [(w_hat - w).to(torch.bfloat16) for w_hat, w in zip(dequantized(candidates[ci], ws, g.linears, stats), ws)]
            for ci in taken[gi]
        ]
        stacked.append([torch.cat([d[li] for d in per_candidate]) if per_candidate else None for li in range(len(ws))])
        del per_candidate
        progress("quantizing candidates", gi + 1, G)
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters()]
    flags = [p.requires_grad for p in params]
    names = [n for g in groups for n in g.linears]
    embed = model.get_input_embeddings()
    device = next(model.parameters()).device
    tokens = 0
    try:
        for p in params:
            p.requires_grad_(False)
        for s in range(batch.shape[0]):
            ids = batch[s : s + 1].to(device)  # (1, T)
            with _capturing(model, names) as (inputs, grads):
                x = embed(ids).detach().requires_grad_(True)
                logits = model(inputs_embeds=x, use_cache=False).logits[0].float()  # (T, V)
                logp = torch.log_softmax(logits, dim=-1)
                y = torch.multinomial(logp.detach().exp().cpu(), 1, generator=gen).to(device)  # (T, 1) from the model
                logp.gather(1, y).sum().backward()
                del logits, logp
                with torch.no_grad():
                    for gi, g in enumerate(groups):
                        if not taken[gi]:
                            continue
                        dot = [0.0] * len(taken[gi])
                        diag = [0.0] * len(taken[gi])
                        for n, dw in zip(g.linears, stacked[gi]):
                            X = inputs[n].reshape(-1, inputs[n].shape[-1]).float()  # (T, K)
                            Gy = grads[n].reshape(-1, grads[n].shape[-1]).float()  # (T, N)
                            # ΔY of every candidate at once, (T, C_g, N); P = G ⊙ ΔY
                            P = (X @ dw.float().T).view(X.shape[0], len(taken[gi]), -1).mul_(Gy.unsqueeze(1))
                            dot = [a + b for a, b in zip(dot, P.sum(dim=(0, 2)).tolist())]
                            diag = [a + b for a, b in zip(diag, P.square_().sum(dim=(0, 2)).tolist())]
                            del P
                        for k, ci in enumerate(taken[gi]):
                            sampled[gi][ci] += 0.5 * dot[k] * dot[k]
                            diagonal[gi][ci] += 0.5 * diag[k]
            tokens += ids.shape[1]
            progress("sensitivity", s + 1, batch.shape[0])
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)
    per_token = [
        [None if not ok[gi][ci] else (0.0 if candidates[ci].scheme is None else v / tokens) for ci, v in enumerate(row)]
        for gi, row in enumerate(sampled)
    ]
    per_token_diag = [
        [None if not ok[gi][ci] else (0.0 if candidates[ci].scheme is None else v / tokens) for ci, v in enumerate(row)]
        for gi, row in enumerate(diagonal)
    ]
    return Sensitivity(list(groups), list(candidates), per_token, per_token_diag, tokens, time.perf_counter() - t0)
