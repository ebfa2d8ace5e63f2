"""Mixture-of-experts layers in the calibration pipeline, on tiny random models of every MoE
family in the table (Mixtral, Qwen2-MoE with its gated shared expert, Qwen3-MoE,
DeepSeek-V3 with MLA, a dense first layer, shared experts and a biased sigmoid router).

References are independent of the pipeline: transformers' own fused experts and router
(hooks on the unmodified model), `save_pretrained`'s tensor names, Hessians recomputed
from the routed rows the HF experts module receives.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from tiny_moe import FAMILIES, make_moe, starving  # noqa: E402

from infer_tool.calib.architectures import ARCHITECTURES, AWQMapping, architecture_for  # noqa: E402
from infer_tool.calib.layers import decoder_layers, linear_shapes, weight_nk  # noqa: E402
from infer_tool.calib.moe import MoeCalibration, MoeExperts, all_tokens, moe_layer, unfuse_experts  # noqa: E402
from infer_tool.calib.pipeline import collect_stats, quantize_model  # noqa: E402
from infer_tool.calib.quantizers.awq import fold_scales  # noqa: E402
from infer_tool.common.errors import BadInput  # noqa: E402
from infer_tool.schemes.registry import make_scheme  # noqa: E402

V, T, B = 300, 24, 6


@pytest.fixture(autouse=True, scope="module")
def one_thread():  # noqa: ANN201
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def arch_of(model: nn.Module):  # noqa: ANN201
    return architecture_for(model.config.model_type, model.config)


@pytest.mark.parametrize("family", FAMILIES)
def test_per_expert_linears_keep_the_model_and_its_checkpoint_names(family: str, tmp_path: Path) -> None:
    """Splitting the fused experts changes no logit, copies no weight (views of the fused
    storage), and the per-expert tensor names, spelled as the original checkpoint's, are
    exactly the names transformers' save_pretrained writes."""
    from safetensors import safe_open

    model = make_moe(family)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    x = ids()
    ref = logits(model, x)
    arch = arch_of(model)
    fused = {
        i: layer.mlp.experts.gate_up_proj.data_ptr()
        for i, layer in enumerate(model.model.layers)
        if arch.experts_in(layer)
    }
    assert unfuse_experts(model, arch) == len(fused) > 0
    assert unfuse_experts(model, arch) == len(fused)  # idempotent
    assert rel(logits(model, x), ref) < 1e-6
    for i, ptr in fused.items():
        experts = model.model.layers[i].mlp.experts
        assert isinstance(experts, MoeExperts)
        assert experts[1].up_proj.weight.untyped_storage().data_ptr() == ptr  # a view, not a copy
    names = {arch.checkpoint_name(k) for k in model.state_dict()} - {"lm_head.weight"}
    assert names == saved - {"lm_head.weight"}
    shapes = linear_shapes(model, arch)
    expected = sum(len(arch.layer_linears(layer)) for layer in decoder_layers(model, arch))
    assert len(shapes) == expected
    assert not any(".gate." in n or n.endswith(".gate") for n in shapes)  # routers are not quantized


def test_all_tokens_mode_feeds_every_expert_and_keeps_the_output() -> None:
    model = make_moe("qwen3_moe")
    arch = arch_of(model)
    unfuse_experts(model, arch)
    layer = model.model.layers[0]
    moe = moe_layer(layer, arch, MoeCalibration())
    seen: list[int] = []
    h = moe.experts[3].gate_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
    x = torch.randn(B, T, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        routed = moe.block(x)
        n_routed = sum(seen)
        seen.clear()
        with all_tokens(moe):
            every = moe.block(x)
    h.remove()
    assert sum(seen) == B * T > n_routed > 0
    assert rel(every, routed) < 1e-6


def _quantize(family: str, method: str, mode: str = "all", **kw):  # noqa: ANN202
    model = make_moe(family)
    scheme = make_scheme(method, **({} if method == "fp8" else {"group_size": 32}))
    r = quantize_model(model, ids(), scheme, batch_size=4, device="cpu", moe=MoeCalibration(mode, **kw))
    return model, r


@pytest.mark.parametrize("family", FAMILIES)
def test_every_expert_quantized_and_gptq_awq_beat_rtn(family: str) -> None:
    """RTN, GPTQ, AWQ and FP8: every linear of every expert (and shared expert) is quantized,
    the model holds exactly the dequantized weights, the routers are untouched, each MoE
    layer reports its routed tokens (k per token), and GPTQ / AWQ beat RTN on the logits."""
    x = ids()
    ref = logits(make_moe(family), x)
    errors = {}
    for method in ("rtn", "gptq", "awq", "fp8"):
        model, r = _quantize(family, method)
        arch = arch_of(model)
        assert set(r.quantized) == set(linear_shapes(model, arch)), method
        assert not r.fallbacks
        for name, w in r.quantized.items():
            W = weight_nk(model.get_submodule(name), False)
            assert torch.equal(W, w.dequantize(W.dtype)), name
        moe_layers = [i for i, layer in enumerate(model.model.layers) if arch.experts_in(layer)]
        assert [t.layer for t in r.expert_tokens] == [f"model.layers.{i}" for i in moe_layers]
        for t in r.expert_tokens:
            assert sum(t.counts) == 2 * t.tokens and t.min <= t.median <= t.max
        errors[method] = rel(logits(model, x), ref)
    assert errors["gptq"] < errors["rtn"] and errors["awq"] < errors["rtn"], errors
    assert errors["fp8"] < errors["rtn"], errors


def test_routers_stay_unquantized_and_awq_folds_into_them() -> None:
    """AWQ divides post_attention_layernorm by s and multiplies every expert's gate/up by s;
    the router (and Qwen2-MoE's shared-expert gate) read the same input, so their weights
    get s too: the routing is unchanged. Without that, the choice of experts moves."""
    x = ids()
    for fold_router in (True, False):
        model = make_moe("qwen2_moe")
        arch = arch_of(model)
        unfuse_experts(model, arch)
        layer = model.model.layers[1]
        moe = moe_layer(layer, arch, MoeCalibration())
        picks = []
        h = moe.experts.register_forward_pre_hook(lambda m, a, picks=picks: picks.append(a[1].clone()))
        ref = logits(model, x)
        gate_ups = [layer.get_submodule(n) for j in range(len(moe)) for n in moe.expert(j)[:2]]
        gate_ups += [layer.get_submodule(n) for n in moe.shared[:2]]
        extra = [layer.get_submodule(n) for n in moe.unquantized] if fold_router else []
        s = torch.rand(64, generator=torch.Generator().manual_seed(3)) * 3 + 0.25
        fold_scales(
            layer.post_attention_layernorm, gate_ups + extra, s, AWQMapping("post_attention_layernorm", (), "mlp"), arch
        )
        got = logits(model, x)
        h.remove()
        same_routing = torch.equal(picks[0], picks[1])
        if fold_router:
            assert same_routing and rel(got, ref) < 1e-4
        else:
            assert not same_routing and rel(got, ref) > 1e-3


@pytest.mark.parametrize("mode", ["routed", "all"])
def test_gptq_one_hessian_per_expert(mode: str) -> None:
    """Expert j's gate/up Hessian is 2XᵀX/n over the rows transformers' own experts module
    receives for it (routed) or over every row (all), after the layer's attention was
    quantized; its down Hessian over its quantized gate/up's intermediate activations."""
    from infer_tool.calib.quantizers import gptq

    captured: dict[str, torch.Tensor] = {}
    original = gptq.GPTQQuantizer.solve

    def spy(self, W, stats, scheme, name, parts=None):  # noqa: ANN001, ANN202
        for n in name.split(", "):  # linears sharing a Hessian are solved together
            captured[n] = stats.H.clone()
        return original(self, W, stats, scheme, name, parts=parts)

    fp = make_moe("mixtral")
    model = copy.deepcopy(fp)
    gptq.GPTQQuantizer.solve = spy
    try:
        r = quantize_model(
            model,
            ids(),
            make_scheme("gptq", group_size=32),
            batch_size=4,
            device="cpu",
            moe=MoeCalibration(mode, min_tokens=1),
        )
    finally:
        gptq.GPTQQuantizer.solve = original
    p = "model.layers.0"
    ref = copy.deepcopy(fp)
    with torch.no_grad():
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            ref.get_submodule(f"{p}.self_attn.{n}").weight.copy_(r.quantized[f"{p}.self_attn.{n}"].dequantize())
    calls = []
    h = ref.model.layers[0].mlp.experts.register_forward_pre_hook(lambda m, a: calls.append((a[0], a[1])))
    logits(ref, ids())
    h.remove()
    X = torch.cat([c[0] for c in calls]).double()
    index = torch.cat([c[1] for c in calls])
    for j in (0, 3):
        rows = X if mode == "all" else X[(index == j).any(-1)]
        H_ref = 2 * rows.T @ rows / rows.shape[0]
        gate = f"{p}.mlp.experts.{j}.gate_proj"
        assert rel(captured[gate].double(), H_ref) < 1e-5, gate
        assert torch.equal(captured[gate], captured[f"{p}.mlp.experts.{j}.up_proj"])
        g = r.quantized[gate].dequantize().double()
        u = r.quantized[f"{p}.mlp.experts.{j}.up_proj"].dequantize().double()
        inter = torch.nn.functional.silu(rows @ g.T) * (rows @ u.T)
        H_down = 2 * inter.T @ inter / inter.shape[0]
        assert rel(captured[f"{p}.mlp.experts.{j}.down_proj"].double(), H_down) < 1e-5
    if mode == "routed":  # a routed Hessian differs from the all-tokens one (else the test is vacuous)
        assert rel(captured[f"{p}.mlp.experts.0.gate_proj"].double(), 2 * X.T @ X / X.shape[0]) > 1e-3


def test_gptq_linears_sharing_a_hessian_solved_together_equal_their_own_solves() -> None:
    """Stacking the rows of linears with one Hessian into one GPTQ solve gives each linear's
    own solve, up to the rounding of the batched matmuls."""
    from infer_tool.calib.stats import StatsAccumulator
    from infer_tool.packers.gptq import quantize_gptq

    g = torch.Generator().manual_seed(0)
    X = torch.randn(400, 64, generator=g) * (torch.rand(64, generator=g) * 3)
    acc = StatsAccumulator(64)
    acc.add(X)
    st = acc.result()
    Ws = [torch.randn(48, 64, generator=g) for _ in range(3)]
    scheme = make_scheme("gptq", group_size=32, act_order=True)
    together = quantize_gptq(torch.cat(Ws), st, scheme)
    alone = torch.cat([quantize_gptq(w, st, scheme).dequantize() for w in Ws])
    assert rel(together.dequantize(), alone) < 1e-3
    assert float((together.dequantize() == alone).float().mean()) > 0.99


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_starved_expert(method: str) -> None:
    """An expert no calibration token reaches: in routed mode it falls back to RTN, counted
    and named; in all mode it is calibrated on every token like the others. Both modes
    list it below the threshold, and neither leaves it unquantized or with a bad scale."""
    from infer_tool.packers.rtn import quantize_rtn

    scheme = make_scheme(method, group_size=32)
    for mode in ("routed", "all"):
        model = make_moe("qwen3_moe")
        fp_up = model.model.layers[1].mlp.experts.gate_up_proj[2, 32:].detach().clone()
        with starving(model, 2):
            r = quantize_model(model, ids(), scheme, batch_size=4, device="cpu", moe=MoeCalibration(mode, min_tokens=8))
        arch = arch_of(model)
        assert set(r.quantized) == set(linear_shapes(model, arch))
        for t in r.expert_tokens:
            assert t.counts[2] == 0 and t.below == [2]
        for w in r.quantized.values():
            assert torch.isfinite(w.scale).all() and (w.scale != 0).all()
        up = "model.layers.1.mlp.experts.2.up_proj"
        if mode == "routed":
            names = {f.layer for f in r.fallbacks}
            assert names == {
                f"model.layers.{i}.mlp.experts.2.{p}" for i in (0, 1) for p in ("gate_proj", "up_proj", "down_proj")
            }
            assert all("0 calibration tokens" in f.reason and f.fallback == "rtn" for f in r.fallbacks)
            if method == "gptq":
                assert torch.equal(r.quantized[up].q, quantize_rtn(fp_up, None, scheme).q)
        else:
            assert not r.fallbacks
            if method == "gptq":
                assert not torch.equal(r.quantized[up].q, quantize_rtn(fp_up, None, scheme).q)


def test_fp8_static_routed_starved_expert_uses_every_token() -> None:
    model, r = None, None
    model = make_moe("mixtral")
    with starving(model, 1):
        r = quantize_model(
            model,
            ids(),
            make_scheme("fp8", activations="static"),
            batch_size=4,
            device="cpu",
            moe=MoeCalibration("routed", min_tokens=8),
        )
    starved = {f.layer for f in r.fallbacks}
    assert "model.layers.0.mlp.experts.1.down_proj" in starved
    assert all(f.fallback == "statistics over every token" for f in r.fallbacks)
    for w in r.quantized.values():
        assert w.input_scale is not None and torch.isfinite(w.input_scale).all() and float(w.input_scale) > 0


@pytest.mark.parametrize("method", ["gptq", "rtn"])
def test_w8a8_static_routed_starved_expert_gets_an_input_scale(method: str) -> None:
    """Static W8A8 on an MoE model: every linear, experts and the starved expert's RTN fallback
    included, gets a finite input_scale, and the int-quantized format accepts the result."""
    from infer_tool.packers.codecs.int_quantized import check

    model = make_moe("mixtral")
    scheme = make_scheme(method, bits=8, group_size=-1, int8_activations="static")
    with starving(model, 1):
        r = quantize_model(model, ids(), scheme, batch_size=4, device="cpu", moe=MoeCalibration("routed", min_tokens=8))
    assert set(r.quantized) == set(linear_shapes(model, arch_of(model)))
    for w in r.quantized.values():
        assert w.input_scale is not None and torch.isfinite(w.input_scale).all() and float(w.input_scale) > 0
    check(scheme, r.quantized)


def test_nan_expert_is_an_error_naming_it() -> None:
    model = make_moe("qwen3_moe")
    with torch.no_grad():
        model.model.layers[1].mlp.experts.gate_up_proj[3, 40, 5] = float("nan")
    with pytest.raises(BadInput, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj"):
        quantize_model(model, ids(), make_scheme("rtn", group_size=32), batch_size=4, device="cpu")


def test_unknown_moe_type_names_what_an_entry_needs() -> None:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    assert "olmoe" not in ARCHITECTURES
    model = OlmoeForCausalLM(
        OlmoeConfig(
            vocab_size=V,
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
        )
    )
    with pytest.raises(
        BadInput, match=r"'olmoe' is a mixture of experts \(4 experts\).*deepseek_v3.*MoE\(block, router"
    ):
        quantize_model(model, ids(), make_scheme("rtn", group_size=32))


def test_bad_mode_and_saved_statistics_refused() -> None:
    with pytest.raises(BadInput, match="all, routed"):
        MoeCalibration("some")
    with pytest.raises(BadInput, match="mixture-of-experts"):
        collect_stats(make_moe("mixtral"), ids(), device="cpu")


@pytest.mark.parametrize("method", ["gptq", "rtn"])
@pytest.mark.parametrize("family", FAMILIES)
def test_smoothquant_on_moe_smooths_the_attention_only(family: str, method: str) -> None:
    """SmoothQuant + W8A8 on every MoE family: each layer's attention input norm is smoothed,
    no mapping into the MoE block's experts (shared or routed) is, every linear is quantized,
    and the smoothed model stays close to the fp one."""
    model = make_moe(family)
    fp = copy.deepcopy(model)
    arch = arch_of(model)
    scheme = make_scheme(method, bits=8, group_size=-1, int8_activations="dynamic", smoothquant=0.5)
    r = quantize_model(model, ids(), scheme, batch_size=4, device="cpu")
    smoothed = [e for e in r.method_report["smoothquant"] if "skipped" not in e]
    layers = len(decoder_layers(model, arch))
    inputs = [e["layer"] for e in smoothed if e["smooth"] == smoothed[0]["smooth"]]
    assert inputs == [f"{arch.layers}.{i}" for i in range(layers)]
    assert not any("expert" in b for e in smoothed for b in e["balance"])
    assert all(e["x_abs_max_after"] < e["x_abs_max_before"] for e in smoothed)
    assert set(r.quantized) == set(linear_shapes(model, arch))
    assert rel(logits(model, ids(2)), logits(fp, ids(2))) < 0.05
