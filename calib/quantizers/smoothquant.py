"""SmoothQuant in the pipeline (Xiao et al. 2023, §4), the step RTN and GPTQ run on a decoder
layer before quantizing it when the scheme asks (`QuantScheme.smoothquant`, the migration
strength α).

For each mapping of the architecture table whose smoothing module is a norm (input norm ->
q/k/v, post-attention norm -> gate/up, Phi-3's fused qkv and gate_up, Gemma's 1 + w norms):
s_j = max|X_j|^α / max|W_j|^(1-α) (`packers/smoothquant.smoothquant_scales`) from the per-channel
maxima of the balance linears' input, folded into the norm and the balance linears by AWQ's one
apply step (`awq_fold.fold_scales`): the layer computes the same function, and its balance
linears see X / s. The linear -> linear mappings (v -> o, up -> down) are left alone, as in the
paper and llm-compressor; in an MoE layer only the attention is smoothed (the context's table
entry holds the attention's mappings), as llm-compressor does (one s over every expert
unbalances them). A mapping is skipped when a balance linear is not quantized (--ignore).

llm-compressor's `SmoothQuantModifier` differs in its statistic: it takes the per-channel range
max(x_j) - min(x_j) of the smoothing module's output, where the paper (and this step) takes
max |x_j|; on a channel symmetric about zero that is 2·max|x_j| (a constant factor 2^(2α-1) in
s, which moves nothing between channels), on an offset channel it smooths less.

This step reads statistics and returns statistics: live (`measure_groups` before it, which
need measure only `smoothed_groups`, ending each chunk's pass there) and from
saved statistics (`quantize --stats`) alike, it gives the statistics of the smoothed inputs
(`LayerStats.divided`), so a static input scale or a Hessian needs no second pass.
"""

from __future__ import annotations

from torch import nn

from infer_tool.calib.architectures import Architecture, get_submodule
from infer_tool.calib.layers import group_of, weight_nk
from infer_tool.calib.quantizers.awq_fold import fold_scales, smooth_channels
from infer_tool.calib.result import PipelineResult
from infer_tool.calib.stats import LayerStats
from infer_tool.packers.smoothquant import smoothquant_scales
from infer_tool.schemes.integer import QuantScheme


def is_norm_mapping(layer: nn.Module, arch: Architecture, smooth_name: str) -> bool:
    """Whether the mapping smoothed by `smooth_name` folds into a norm (the mappings this step
    smooths; a linear -> linear one it leaves alone)."""
    smooth = get_submodule(layer, smooth_name)
    return not (isinstance(smooth, nn.Linear) or (arch.conv1d and smooth.weight.dim() == 2))


def smoothed_groups(layer: nn.Module, arch: Architecture) -> list[str]:
    """The first linear of each group whose input `smooth_layer` reads: the groups the norm
    mappings balance (a pass measuring them can end once these have read each chunk)."""
    keys = [group_of(arch, m.balance[0]) for m in arch.mappings if is_norm_mapping(layer, arch, m.smooth)]
    return list(dict.fromkeys(keys))


def smooth_layer(
    layer: nn.Module,
    prefix: str,
    arch: Architecture,
    alpha: float,
    stats: dict[str, LayerStats],
    *,
    targets: set[str],
    result: PipelineResult,
) -> dict[str, LayerStats]:
    """Fold SmoothQuant's s into every norm mapping of `layer` (named `prefix`); `stats`:
    {first linear of a group: its input's statistics, with per-channel maxima}. Returns the
    same dict with the statistics of each smoothed group's new input; one report entry per
    mapping goes to `result.method_report["smoothquant"]`."""
    entries = result.method_report.setdefault("smoothquant", [])
    out = dict(stats)
    for m in arch.mappings:
        if not is_norm_mapping(layer, arch, m.smooth):
            continue  # linear -> linear: not smoothed (see the module docstring)
        smooth = get_submodule(layer, m.smooth)
        entry = {"layer": prefix, "smooth": m.smooth, "balance": list(m.balance), "alpha": alpha}
        balance = [get_submodule(layer, b) for b in m.balance]
        K = int(weight_nk(balance[0], arch.conv1d).shape[1])
        if not all(f"{prefix}.{b}" in targets for b in m.balance):
            entries.append({**entry, "skipped": "a balance layer is not quantized (--ignore)"})
            continue
        if smooth_channels(smooth, arch) != K * (m.part[1] if m.part else 1):
            entries.append(
                {
                    **entry,
                    "skipped": f"{m.smooth} has {smooth_channels(smooth, arch)} outputs, {m.balance[0]} reads {K}",
                }
            )
            continue
        key = group_of(arch, m.balance[0])
        st = out[key]
        if st.act_abs_max_channel is None:
            raise ValueError(f"{prefix}.{key}: SmoothQuant needs the per-channel maxima of its input")
        s = smoothquant_scales(st.act_abs_max_channel, [weight_nk(b, arch.conv1d) for b in balance], alpha)
        fold_scales(smooth, balance, s, m, arch)
        out[key] = st.divided(s)
        entries.append(
            {
                **entry,
                "s_min": float(s.min()),
                "s_max": float(s.max()),
                "x_abs_max_before": st.act_abs_max,
                "x_abs_max_after": out[key].act_abs_max,
            }
        )
    return out


def smooth_saved(
    layer: nn.Module,
    prefix: str,
    arch: Architecture,
    alpha: float,
    stats: dict[str, LayerStats],
    *,
    targets: set[str],
    result: PipelineResult,
) -> dict[str, LayerStats]:
    """`smooth_layer` on saved statistics keyed by every linear of the layer (a group's linears
    share one object): the same keys, each linear given its group's new statistics."""
    heads = {group[0]: stats[group[0]] for group in arch.groups if group[0] in stats}
    smoothed = smooth_layer(layer, prefix, arch, alpha, heads, targets=targets, result=result)
    return {n: smoothed.get(group_of(arch, n), st) for n, st in stats.items()}


class SmoothsSavedStats:
    """`LayerQuantizer.prepare_stats` for the INT quantizers that take `QuantScheme.smoothquant`
    (mixed in before `LayerQuantizer`): with SmoothQuant, `smooth_saved`; else unchanged."""

    def prepare_stats(
        self,
        layer: nn.Module,
        prefix: str,
        arch: Architecture,
        stats: dict[str, LayerStats],
        *,
        targets: set[str],
        result: PipelineResult,
        scheme: QuantScheme,
    ) -> dict[str, LayerStats]:
        if scheme.smoothquant is None:
            return stats
        return smooth_saved(layer, prefix, arch, scheme.smoothquant, stats, targets=targets, result=result)
