"""FP4 solvers (pure functions, `(W (N, K), LayerStats | None, scheme) -> Fp4Weight`): RTN and
GPTQ on the E2M1 grid, the global scale fused shards share, and the quantize-dequantize AWQ's
searches score with. The numerics are `packers/fp4.py`'s.

- Global scale (NVFP4): `448·6 / max|w|` over every shard of one fused linear (q/k/v, gate/up,
  an expert's w1/w3), in the scheme's `amax_dtype` (llm-compressor's fused observers,
  `observers/helpers.py`): vLLM keeps one per fused linear (the shards' max for dense layers,
  w1's for MoE), so shards that share one lose nothing to that collapse. MXFP4 has none.
- Group scales by the scheme's observer, on the weights as given: "minmax" (each group's max
  |w|, in `amax_dtype`) or "mse" (`fp4.mse_group_amax` with the global scale: the shrink of
  the max minimising sum |Q(w) - w|^2.4, scored with the stored E4M3 / E8M0 scale). The global
  scale stays the min-max one (llm-compressor's MSE observer takes it from the shrunk maxima
  and scores unrounded scales).
- GPTQ (Frantar et al. 2022, Algorithm 1, `packers/gptq.solve_columns`): every group's scale
  from the observer on the ORIGINAL weights, fixed through the solve (static groups: column k
  keeps group k // g in any column order, llm-compressor's `quantize_weight`); each column
  rounds to `fake_quantize(w, its group's effective scale)`; the codes of the result at the end.
  A failed factorisation falls back to RTN with the same global scale.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infer_tool.packers import fp4
from infer_tool.packers.fp4_weight import Fp4Weight
from infer_tool.packers.gptq import fallback_info, prepare, solve_columns, solved_info
from infer_tool.schemes.fp4 import Fp4GPTQScheme, Fp4RTNScheme, Fp4Scheme


def _amax_dtype(scheme: Fp4Scheme) -> torch.dtype:
    return getattr(torch, scheme.amax_dtype)


def fp4_global_scale(weights: Sequence[torch.Tensor], scheme: Fp4Scheme) -> torch.Tensor | None:
    """float32 `(1,)` global scale the shards `weights` (each (N_i, K)) share; None for MXFP4."""
    if not scheme.global_scales:
        return None
    dt = _amax_dtype(scheme)
    return fp4.nvfp4_fused_global_scale(*(w.detach().to(dt) for w in weights))


def input_global_scale(act_abs_max: float, scheme: Fp4Scheme) -> torch.Tensor | None:
    """NVFP4 W4A4's static `input_global_scale` `(1,)` float32 from the calibration max |x| of a
    linear's input; None for weights-only or MXFP4 schemes."""
    if not (scheme.w4a4 and scheme.global_scales):
        return None
    return fp4.nvfp4_global_scale(torch.tensor([act_abs_max], dtype=torch.float32).to(_amax_dtype(scheme)))


def group_scales(W: torch.Tensor, scheme: Fp4Scheme, global_scale: torch.Tensor | None) -> torch.Tensor:
    """Stored group scales `(N, K/g)` (float8_e4m3fn / uint8 E8M0) of W by the scheme's observer."""
    if scheme.observer == "mse":
        amax_g = fp4.mse_group_amax(W.float(), scheme.fp4, global_scale)
    else:
        amax_g = fp4.group_amax(W.detach().to(_amax_dtype(scheme)), scheme.group_size)
    if scheme.global_scales:
        return fp4.nvfp4_group_scales(amax_g, global_scale)
    return fp4.mxfp4_group_scales(amax_g)


def _weight(
    codes: torch.Tensor, w_scale: torch.Tensor, gs: torch.Tensor | None, scheme: Fp4Scheme, info: dict[str, object]
) -> Fp4Weight:
    return Fp4Weight(
        codes=codes,
        w_scale=w_scale,
        global_scale=None if gs is None else gs.to(torch.float32),
        activations=scheme.fp4_activations,
        info=info,
    )


def quantize_fp4_rtn(
    weight: torch.Tensor,
    stats: object | None = None,
    scheme: Fp4Scheme = Fp4RTNScheme(),
    *,
    global_scale: torch.Tensor | None = None,
) -> Fp4Weight:
    """Round W (N, K) to the FP4 grid with the observer's group scales. `global_scale`: the
    fused shards' (NVFP4; `(1,)` or `(N, 1)` per row), default W's own. `stats` is unused."""
    gs = global_scale if global_scale is not None else fp4_global_scale([weight], scheme)
    w_scale = group_scales(weight, scheme, gs)
    eff = fp4.effective_scale(w_scale, None if gs is None else gs.reshape(-1, 1))
    return _weight(fp4.quantize_codes(weight.float(), eff), w_scale, gs, scheme, {"method": "rtn"})


def quantize_fp4_gptq(
    weight: torch.Tensor,
    stats: object,
    scheme: Fp4GPTQScheme = Fp4GPTQScheme(),
    *,
    global_scale: torch.Tensor | None = None,
    parts: Sequence[int] | None = None,
) -> Fp4Weight:
    """GPTQ of W (N, K) onto the FP4 grid (module docstring). stats: LayerStats (`.H` (K, K))
    or the Hessian itself; `global_scale` as in `quantize_fp4_rtn`. info as INT GPTQ's: method,
    damp, attempts, fallback (None or "rtn") and reason, dead columns, loss; `parts` (stacked
    linears) as `quantize_gptq`'s."""
    K = int(weight.shape[1])
    g = scheme.group_size
    if K % g:
        raise ValueError(f"FP4: K={K} is not a multiple of the group size {g}")
    gs = global_scale if global_scale is not None else fp4_global_scale([weight], scheme)
    w_scale = group_scales(weight, scheme, gs)  # the original weights' (static groups)
    eff = fp4.effective_scale(w_scale, None if gs is None else gs.reshape(-1, 1))  # (N, G)

    def fallback(reason: str, attempts: int, dead: int) -> Fp4Weight:
        w = quantize_fp4_rtn(weight, None, scheme, global_scale=gs)
        w.info = fallback_info(reason, attempts, dead)
        return w

    p = prepare(weight, stats, scheme.act_order)
    if p is None:
        return fallback("Hessian has non-finite entries", 0, 0)
    cols = fp4.expand_scales(eff, g)  # (N, K): column k's scale, original order
    if p.perm is not None:
        cols = cols[:, p.perm]

    def fp4_column(col: int, W1: torch.Tensor, i: int, W: torch.Tensor, i2: int) -> tuple[torch.Tensor, torch.Tensor]:
        deq = fp4.fake_quantize(W1[:, i], cols[:, col])  # (N,)
        return deq, deq

    solved = solve_columns(p, fp4_column, scheme, parts)
    if isinstance(solved, str):
        return fallback(solved, scheme.damp_retries + 1, p.dead)
    info = solved_info(solved, p.dead, parts)
    return _weight(fp4.quantize_codes(solved.Q, eff), w_scale, gs, scheme, info)


def fake_quantize_shards(weights: Sequence[torch.Tensor], scheme: Fp4Scheme) -> list[torch.Tensor]:
    """Min-max quantize-dequantize of fused shards (each (N_i, K)) with one global scale from
    all of them, each in its dtype: what AWQ's scale search scores its candidates with."""
    gs = fp4_global_scale(weights, scheme)
    return [fp4.fake_quantize_weight(w, scheme.fp4, gs) for w in weights]
