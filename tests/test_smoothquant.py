"""SmoothQuant's factors (`packers/smoothquant.py`) against the paper's formula in float64, its
balance property, and folded by AWQ's one apply step (`calib/quantizers/awq_fold.fold_scales`)
into every dense architecture of the table: the model's logits stay what they were.
(llm-compressor's own function on the same tensors: `tests/smoothquant_llmc_check.py`, run in
its environment.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_pipeline import TYPES, ids, tiny_model

from infer_tool.calib.architectures import Architecture, architecture_for, get_submodule
from infer_tool.calib.layers import decoder_layers, weight_nk
from infer_tool.calib.quantizers.awq_fold import fold_scales, smooth_channels
from infer_tool.packers.smoothquant import MIN_SCALE, smoothquant_scales, weight_abs_max


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny tensors: one thread (a pool's barriers stall on shared cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def case(K: int = 96, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x_max = torch.rand(K, generator=g) * 2 + 0.01
    x_max[::11] *= 100.0  # outlier channels
    weights = [torch.randn(n, K, generator=g) * 0.05 for n in (32, 16, 16)]
    return x_max, weights


@pytest.mark.parametrize("alpha", (0.0, 0.5, 0.8, 1.0))
def test_scales_are_the_papers_formula(alpha: float) -> None:
    """s_j = max|X_j|^α / max|W_j|^(1-α), the weight maximum over every balance linear's column
    j (element by element in float64: no reductions shared with the implementation)."""
    x_max, weights = case()
    s = smoothquant_scales(x_max, weights, alpha)
    assert s.dtype == torch.float32 and s.shape == (96,)
    for j in range(0, 96, 7):
        w_j = max(float(abs(w[n, j])) for w in weights for n in range(w.shape[0]))
        want = float(x_max[j]) ** alpha / w_j ** (1 - alpha)
        assert float(s[j]) == pytest.approx(want, rel=2e-6)


@pytest.mark.parametrize("alpha", (0.25, 0.5, 0.8))
def test_smoothing_splits_each_channels_range(alpha: float) -> None:
    """After X / s and W · s: max|X̂_j| = (max|X_j| max|W_j|)^(1-α), max|Ŵ_j| = (max|X_j| max|W_j|)^α
    (§4 eq. 4; equal at α = 0.5), and X·Wᵀ is unchanged."""
    g = torch.Generator().manual_seed(1)
    X = torch.randn(200, 64, generator=g)
    X[:, 5] *= 80.0
    weights = [torch.randn(24, 64, generator=g) * 0.1, torch.randn(8, 64, generator=g) * 0.1]
    x_max = X.abs().amax(dim=0)
    s = smoothquant_scales(x_max, weights, alpha)
    prod = (x_max * weight_abs_max(weights)).double()
    torch.testing.assert_close((X / s).abs().amax(dim=0).double(), prod ** (1 - alpha), rtol=1e-5, atol=0)
    torch.testing.assert_close(weight_abs_max([w * s for w in weights]).double(), prod**alpha, rtol=1e-5, atol=0)
    for w in weights:
        torch.testing.assert_close((X / s) @ (w * s).T, X @ w.T, rtol=1e-5, atol=1e-5)
    assert int(torch.argmax(s)) == 5  # the outlier channel is the one divided most


def test_dead_channels_are_left_alone_and_scales_bounded() -> None:
    x_max, weights = case()
    x_max[3] = 0.0
    for w in weights:
        w[:, 4] = 0.0
    x_max[6] = 1e30
    s = smoothquant_scales(x_max, weights, 0.5)
    assert float(s[3]) == 1.0 and float(s[4]) == 1.0
    assert float(s[6]) == pytest.approx(1 / MIN_SCALE, rel=1e-7)  # clamped
    assert bool((s >= MIN_SCALE).all())


def test_bad_input() -> None:
    x_max, weights = case()
    with pytest.raises(ValueError, match="alpha"):
        smoothquant_scales(x_max, weights, 1.5)
    with pytest.raises(ValueError, match="one K"):
        smoothquant_scales(x_max, [weights[0], weights[1][:, :10]], 0.5)
    with pytest.raises(ValueError, match="activation maxima"):
        smoothquant_scales(x_max[:10], weights, 0.5)
    with pytest.raises(ValueError, match="finite"):
        smoothquant_scales(torch.full_like(x_max, float("nan")), weights, 0.5)


def _balance_input_maxima(
    model: torch.nn.Module, arch: Architecture, tokens: torch.Tensor
) -> dict[tuple[int, str], torch.Tensor]:
    """{(layer index, first balance linear): max |x| per input channel} over the tokens' forward."""
    found: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(decoder_layers(model, arch)):
        for m in arch.mappings:
            key = (i, m.balance[0])

            def grab(mod: torch.nn.Module, args: tuple[Any, ...], key: tuple[int, str] = key) -> None:
                x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0)
                found[key] = torch.maximum(found[key], x) if key in found else x

            hooks.append(get_submodule(layer, m.balance[0]).register_forward_pre_hook(grab))
    with torch.no_grad():
        model(input_ids=tokens, use_cache=False)
    for h in hooks:
        h.remove()
    return found


@pytest.mark.parametrize("model_type", TYPES)
def test_folding_leaves_logits_unchanged(model_type: str) -> None:
    """SmoothQuant's factors from measured activations, folded with AWQ's `fold_scales` into
    every mapping of the architecture table whose shapes line up (norm -> linears, fused
    slices, Gemma's 1 + w norms, GPT-2's Conv1D): the fp32 logits agree to float tolerance, and
    the inputs the balance linears now see are the old ones divided by s."""
    model = tiny_model(model_type)
    arch = architecture_for(model_type)
    tokens = ids()
    with torch.no_grad():
        ref = model(input_ids=tokens, use_cache=False).logits
    maxima = _balance_input_maxima(model, arch, tokens)
    folded, scales = 0, {}
    for i, layer in enumerate(decoder_layers(model, arch)):
        for m in arch.mappings:
            smooth = get_submodule(layer, m.smooth)
            balance = [get_submodule(layer, b) for b in m.balance]
            K = int(weight_nk(balance[0], arch.conv1d).shape[1])
            if smooth_channels(smooth, arch) != K * (m.part[1] if m.part else 1):
                continue  # GQA: v has fewer outputs than o has inputs (AWQ skips it too)
            s = smoothquant_scales(maxima[(i, m.balance[0])], [weight_nk(b, arch.conv1d) for b in balance], 0.5)
            assert float((s - 1).abs().max()) > 0.1  # a real change of the weights
            fold_scales(smooth, balance, s, m, arch)
            scales[(i, m.balance[0])] = s
            folded += 1
    assert folded >= 2 * len(decoder_layers(model, arch))
    with torch.no_grad():
        out = model(input_ids=tokens, use_cache=False).logits
    assert float((out - ref).norm() / ref.norm()) < 1e-5
    after = _balance_input_maxima(model, arch, tokens)
    for key, s in scales.items():
        torch.testing.assert_close(after[key], maxima[key] / s, rtol=1e-4, atol=1e-6)


def _targets(model: torch.nn.Module, arch: Architecture) -> set[str]:
    from infer_tool.calib.layers import linear_shapes

    return set(linear_shapes(model, arch))


@pytest.mark.parametrize("model_type", TYPES)
def test_pipeline_step_leaves_logits_unchanged(model_type: str) -> None:
    """The pipeline's SmoothQuant step (`smooth_layer`), from the statistics `calibrate`
    measures, on every dense architecture of the table: the norm mappings are smoothed, the
    fp32 logits stay within 1e-5, and the statistics it returns are those of the balance
    linears' new inputs (measured again after the fold)."""
    from infer_tool.calib.pipeline import collect_stats
    from infer_tool.calib.quantizers.smoothquant import smooth_layer
    from infer_tool.calib.result import PipelineResult

    model = tiny_model(model_type)
    arch = architecture_for(model_type)
    tokens = ids()
    with torch.no_grad():
        ref = model(input_ids=tokens, use_cache=False).logits
    before = collect_stats(model, tokens, batch_size=4, device="cpu").stats
    result, targets, returned = PipelineResult(), _targets(model, arch), {}
    for i, layer in enumerate(decoder_layers(model, arch)):
        prefix = f"{arch.layers}.{i}"
        heads = {g[0]: before[f"{prefix}.{g[0]}"] for g in arch.groups}
        returned[prefix] = smooth_layer(layer, prefix, arch, 0.5, heads, targets=targets, result=result)
    entries = result.method_report["smoothquant"]
    smoothed = [e for e in entries if "skipped" not in e]
    assert len(smoothed) == 2 * len(decoder_layers(model, arch))  # attention and MLP norms of every layer
    assert all(e["x_abs_max_after"] < e["x_abs_max_before"] for e in smoothed)
    with torch.no_grad():
        out = model(input_ids=tokens, use_cache=False).logits
    assert float((out - ref).norm() / ref.norm()) < 1e-5
    after = collect_stats(model, tokens, batch_size=4, device="cpu").stats
    for prefix, stats in returned.items():
        for head, st in stats.items():
            torch.testing.assert_close(
                st.act_abs_max_channel, after[f"{prefix}.{head}"].act_abs_max_channel, rtol=1e-4, atol=1e-6
            )


def test_smoothquant_in_gptq_and_rtn_live_and_from_saved_statistics() -> None:
    """SmoothQuant + W8A8 through the pipeline: GPTQ live and from saved statistics choose the
    same s for layer 0 (both measured on its fp inputs); RTN with static activations stores
    input_scale = max|x| / 127 of the smoothed input (measured on the quantized model); a
    smoothed GPTQ run differs from an unsmoothed one."""
    import copy

    from infer_tool.calib.pipeline import collect_stats, quantize_from_stats, quantize_model
    from infer_tool.schemes.registry import make_scheme

    model = tiny_model("llama")
    tokens = ids()
    w8a8 = dict(bits=8, group_size=-1, int8_activations="dynamic")
    live = quantize_model(
        copy.deepcopy(model), tokens, make_scheme("gptq", smoothquant=0.5, **w8a8), batch_size=4, device="cpu"
    )
    saved = collect_stats(model, tokens, batch_size=4, device="cpu").stats
    reused = quantize_from_stats(
        copy.deepcopy(model), saved, make_scheme("gptq", smoothquant=0.5, **w8a8), device="cpu"
    )
    first = [(e["layer"], e["smooth"], e["s_min"], e["s_max"]) for e in live.method_report["smoothquant"][:2]]
    assert first == [(e["layer"], e["smooth"], e["s_min"], e["s_max"]) for e in reused.method_report["smoothquant"][:2]]
    plain = quantize_model(copy.deepcopy(model), tokens, make_scheme("gptq", **w8a8), batch_size=4, device="cpu")
    q = "model.layers.0.self_attn.q_proj"
    assert not torch.equal(plain.quantized[q].q, live.quantized[q].q)

    quantized = copy.deepcopy(model)
    rtn = quantize_model(
        quantized,
        tokens,
        make_scheme("rtn", smoothquant=0.8, **{**w8a8, "int8_activations": "static"}),
        batch_size=4,
        device="cpu",
    )
    seen = []
    h = quantized.get_submodule(q).register_forward_pre_hook(lambda m, a: seen.append(a[0].abs().max()))
    with torch.no_grad():
        quantized(input_ids=tokens, use_cache=False)
    h.remove()
    assert float(rtn.quantized[q].input_scale) == pytest.approx(float(max(seen)) / 127, rel=1e-5)


@pytest.mark.parametrize("model_type", TYPES)
def test_smoothing_pass_ends_at_the_norm_mappings(model_type: str) -> None:
    """GPTQ's SmoothQuant pass measures only `smoothed_groups` and ends each chunk there: the
    statistics it returns are, bit for bit, those of a whole-layer pass for the same groups,
    and no linear after the last of them runs (on a sequential layer, the MLP's down)."""
    from infer_tool.calib.layers import capture_inputs, group_of
    from infer_tool.calib.quantizers.base import LayerContext, measure_groups
    from infer_tool.calib.quantizers.smoothquant import smoothed_groups
    from infer_tool.calib.result import PipelineResult

    model = tiny_model(model_type)
    arch = architecture_for(model_type)
    X, calls = capture_inputs(model, arch, ids(), 4, torch.device("cpu"))
    layer = decoder_layers(model, arch)[0]
    ctx = LayerContext(
        layer, "l0", X, calls[0], arch=arch, targets=set(), result=PipelineResult(), error_chunks=1, search_chunks=1
    )
    only = smoothed_groups(layer, arch)
    norms = [m for m in arch.mappings if get_submodule(layer, m.smooth).weight.dim() == 1]  # a norm's (D,)
    assert only and set(only) == {group_of(arch, m.balance[0]) for m in norms}
    full = measure_groups(ctx)
    ran: dict[str, int] = {g[0]: 0 for g in arch.groups}
    hooks = [
        get_submodule(layer, k).register_forward_pre_hook(lambda m, a, k=k: ran.__setitem__(k, ran[k] + 1)) for k in ran
    ]
    part = measure_groups(ctx, only=only)
    for h in hooks:
        h.remove()
    assert set(part) == set(only)
    for k in only:
        assert torch.equal(part[k].act_abs_max_channel, full[k].act_abs_max_channel)
        assert part[k].tokens == full[k].tokens
        assert ran[k] == len(X)
    last = arch.groups[-1][0]
    if last not in only:
        assert ran[last] == 0
