"""`--method awq+gptq` (`calib/quantizers/awq_gptq.py`): the same checkpoint as AWQ's search
and fold followed by GPTQ run by hand from their own schemes; GPTQ's Hessian is the one of
the smoothed inputs x / s (not of x, llm-compressor 0.14's order); it beats AWQ alone on a
tiny trained Llama's held-out logits; its checkpoint loads in transformers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from test_quantize_cli import one_thread, quantize, reference_model, tiny  # noqa: F401  (fixtures)

from infer_tool.calib.quantizers import register_quantizer
from infer_tool.calib.quantizers.awq import AWQQuantizer
from infer_tool.calib.quantizers.base import LayerContext, LayerOutputs, LayerQuantizer
from infer_tool.calib.quantizers.fp4 import Fp4AWQQuantizer, Fp4GPTQQuantizer
from infer_tool.calib.quantizers.gptq import GPTQQuantizer
from infer_tool.schemes.fp4 import Fp4AWQGPTQScheme, Fp4AWQScheme, Fp4GPTQScheme
from infer_tool.schemes.integer import AWQGPTQScheme, AWQScheme, GPTQScheme
from infer_tool.schemes.registry import make_scheme


@dataclasses.dataclass(frozen=True)
class ByHand(AWQGPTQScheme):
    method = "awq-then-gptq-by-hand"


@register_quantizer(ByHand)
class ByHandQuantizer(LayerQuantizer[ByHand]):
    """The two steps written out from schemes built field by field (not `scheme.awq()` / `gptq()`)."""

    def needs(self, scheme: ByHand):  # noqa: ANN201
        return dataclasses.replace(GPTQQuantizer().needs(GPTQScheme()), activation_stats=True, live_blocks=True)

    def quantize_layer(self, ctx: LayerContext, scheme: ByHand) -> LayerOutputs:
        common = {
            "bits": scheme.bits,
            "group_size": scheme.group_size,
            "symmetric": scheme.symmetric,
            "scale_dtype": scheme.scale_dtype,
        }
        Y = AWQQuantizer().search_and_fold(ctx, AWQScheme(**common, clip=False)).Y
        del ctx.result.expert_tokens[:]
        _, Y_hat = GPTQQuantizer().quantize_layer(ctx, GPTQScheme(**common))
        return LayerOutputs(Y[: ctx.error_chunks], Y_hat)


@dataclasses.dataclass(frozen=True)
class ByHandFp4(Fp4AWQGPTQScheme):
    method = "fp4-awq-then-gptq-by-hand"


@register_quantizer(ByHandFp4)
class ByHandFp4Quantizer(LayerQuantizer[ByHandFp4]):
    """The FP4 steps written out: the FP4 AWQ quantizer's search and fold, then the FP4 GPTQ
    quantizer's layer, from schemes built field by field."""

    def needs(self, scheme: ByHandFp4):  # noqa: ANN201
        return dataclasses.replace(GPTQQuantizer().needs(GPTQScheme()), activation_stats=True, live_blocks=True)

    def quantize_layer(self, ctx: LayerContext, scheme: ByHandFp4) -> LayerOutputs:
        fmt = {"fp4": scheme.fp4, "fp4_activations": scheme.fp4_activations, "amax_dtype": scheme.amax_dtype}
        Y = Fp4AWQQuantizer().search_and_fold(ctx, Fp4AWQScheme(**fmt, clip=False)).Y
        del ctx.result.expert_tokens[:]
        _, Y_hat = Fp4GPTQQuantizer().quantize_layer(ctx, Fp4GPTQScheme(**fmt))
        return LayerOutputs(Y[: ctx.error_chunks], Y_hat)


def batch(tiny: dict[str, Path], n: int = 8) -> torch.Tensor:  # noqa: F811
    from transformers import AutoTokenizer

    from infer_tool.calib.corpora import calibration_batch

    return calibration_batch(AutoTokenizer.from_pretrained(tiny["model"]), str(tiny["calib"]), n, 32, 0)


def fp_model(tiny: dict[str, Path]) -> torch.nn.Module:  # noqa: F811
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny["model"], dtype=torch.float32).eval()


@pytest.mark.parametrize("symmetric", [True, False])
def test_equals_awq_search_and_fold_then_gptq_by_hand(tiny: dict[str, Path], symmetric: bool) -> None:  # noqa: F811
    from infer_tool.calib.pipeline import quantize_model

    ids = batch(tiny)
    results = []
    for scheme in (
        make_scheme("awq+gptq", group_size=32, symmetric=symmetric),
        ByHand(group_size=32, symmetric=symmetric),
    ):
        model = fp_model(tiny)
        results.append((quantize_model(model, ids, scheme, device="cpu"), model.state_dict()))
    (a, state_a), (b, state_b) = results
    assert sorted(a.quantized) == sorted(b.quantized) and len(a.quantized) == 14
    for name in a.quantized:
        qa, qb = a.quantized[name], b.quantized[name]
        assert torch.equal(qa.q, qb.q) and torch.equal(qa.scale, qb.scale), name
        assert (qa.zero is None) == symmetric and (symmetric or torch.equal(qa.zero, qb.zero)), name
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)  # the folded norms too
    assert a.method_report["awq"] == b.method_report["awq"] and a.linear_errors == b.linear_errors


@pytest.mark.parametrize(("fmt", "activations"), [("nvfp4", "fp4"), ("mxfp4", "none")])
def test_fp4_equals_fp4_awq_then_fp4_gptq_by_hand(tiny: dict[str, Path], fmt: str, activations: str) -> None:  # noqa: F811
    """`--method awq+gptq --fp4 ...` is the FP4 AWQ step then the FP4 GPTQ step: the same
    codes, group and global scales, input global scales (W4A4) and folded norms; the global
    scales of fused shards are those of the folded weights, not of the source's."""
    from infer_tool.calib.pipeline import quantize_model

    ids = batch(tiny)
    results = []
    for scheme in (
        make_scheme("awq+gptq", fp4=fmt, fp4_activations=activations),
        ByHandFp4(fp4=fmt, fp4_activations=activations),
    ):
        model = fp_model(tiny)
        results.append((quantize_model(model, ids, scheme, device="cpu"), model.state_dict()))
    (a, state_a), (b, state_b) = results
    assert type(make_scheme("awq+gptq", fp4=fmt)) is Fp4AWQGPTQScheme
    assert sorted(a.quantized) == sorted(b.quantized) and len(a.quantized) == 14
    for name in a.quantized:
        qa, qb = a.quantized[name], b.quantized[name]
        for field in ("codes", "w_scale", "global_scale", "input_global_scale"):
            x, y = getattr(qa, field), getattr(qb, field)
            assert (x is None and y is None) or torch.equal(x, y), (name, field)
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)  # the folded norms too
    assert a.method_report["awq"] == b.method_report["awq"] and a.linear_errors == b.linear_errors
    if fmt == "nvfp4":  # q/k/v's one global scale is that of the weights AWQ folded s into
        from infer_tool.packers.fp4_solve import fp4_global_scale

        src = fp_model(tiny).model.layers[0]
        s = src.input_layernorm.weight.detach() / state_a["model.layers.0.input_layernorm.weight"]
        assert float((s - 1).abs().max()) > 0.1
        qkv = [getattr(src.self_attn, p).weight.detach() for p in ("q_proj", "k_proj", "v_proj")]
        scheme = make_scheme("gptq", fp4="nvfp4")
        folded, unfolded = fp4_global_scale([w * s for w in qkv], scheme), fp4_global_scale(qkv, scheme)
        for p in ("q_proj", "k_proj", "v_proj"):
            gs = a.quantized[f"model.layers.0.self_attn.{p}"].global_scale
            assert float(gs) == pytest.approx(float(folded), rel=1e-5)
            assert float(gs) != pytest.approx(float(unfolded), rel=1e-3)
            assert a.quantized[f"model.layers.0.self_attn.{p}"].input_global_scale is not None


def test_gptq_hessian_is_of_the_smoothed_inputs(tiny: dict[str, Path]) -> None:  # noqa: F811
    """Layer 0's q/k/v Hessian equals diag(1/s)·H_x·diag(1/s), with H_x that of the fp
    input_layernorm output and s the scale AWQ folded into that norm (read back from it)."""
    from infer_tool.calib.pipeline import quantize_model
    from infer_tool.calib.stats import StatsAccumulator

    ids = batch(tiny)
    fp = fp_model(tiny)
    seen: list[torch.Tensor] = []
    norm = fp.model.layers[0].input_layernorm
    handle = norm.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    with torch.no_grad():
        fp(ids[:4])
        fp(ids[4:])
    handle.remove()
    model = fp_model(tiny)
    result = quantize_model(model, ids, make_scheme("awq+gptq", group_size=32), device="cpu")
    assert result.method_report["awq"][0]["smooth"] == "input_layernorm" and result.method_report["awq"][0]["ratio"]
    s = norm.weight.detach() / model.model.layers[0].input_layernorm.weight.detach()  # the fold divided the norm by s
    assert float((s - 1).abs().max()) > 0.1  # a real smoothing: H of x and of x / s differ
    acc_x, acc_xs = StatsAccumulator(s.numel()), StatsAccumulator(s.numel())
    for x in seen:
        acc_x.add(x)
        acc_xs.add(x / s)
    H = result.stats["model.layers.0.self_attn.q_proj"].H.double()
    want = acc_x.result().H.double() / s.double().outer(s.double())
    assert float((H - want).norm() / want.norm()) < 1e-4
    assert float((H - acc_xs.result().H.double()).norm() / want.norm()) < 1e-4
    assert float((H - acc_x.result().H.double()).norm() / want.norm()) > 0.05  # not the unsmoothed Hessian


def test_beats_awq_and_rtn_on_held_out_logits(tiny: dict[str, Path]) -> None:  # noqa: F811
    """GPTQ's rounding of the smoothed weights beats AWQ's clipped RTN of them. (Against GPTQ
    alone it is no win on this tiny model: AWQ picks its scales by how RTN rounds them; the
    demo model's numbers are in the benchmark.)"""
    from transformers import AutoTokenizer

    from infer_tool.calib.corpora import tokenize
    from infer_tool.calib.pipeline import quantize_model

    ids = batch(tiny, 16)
    held_out = tokenize(tiny["eval"].read_text(), AutoTokenizer.from_pretrained(tiny["model"]), 256).reshape(4, 64)
    with torch.no_grad():
        want = fp_model(tiny)(held_out).logits
    errors = {}
    for method in ("awq+gptq", "gptq", "awq", "rtn"):
        model = fp_model(tiny)
        quantize_model(model, ids, make_scheme(method, group_size=32, symmetric=True), device="cpu")
        with torch.no_grad():
            errors[method] = float((model(held_out).logits - want).norm() / want.norm())
    assert errors["awq+gptq"] < 0.9 * errors["awq"] and errors["awq"] < errors["rtn"], errors


def test_checkpoint_loads_in_transformers(tiny: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ckpt"
    code, stdout, stderr = quantize(tiny, out, "--method", "awq+gptq", "--group-size", "32", "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["scheme_description"] == "awq+gptq w4 g32 sym act-order" and report["awq"] and report["linear_errors"]
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours, quantized = reference_model(tiny, out)
    assert len(quantized) == 14
    x = torch.randint(3, 93, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = loaded(x).logits, ours(x).logits
    assert float((a - b).norm() / b.norm()) < 1e-4


def test_stats_are_refused_and_clip_options_are_not_offered(tiny: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "stats_index.json").write_text("{}")
    code, _, stderr = quantize(tiny, tmp_path / "x", "--method", "awq+gptq", "--stats", str(tmp_path / "s"))
    assert code == 2 and "AWQ's scale search needs block outputs" in stderr, stderr
    assert "clip" not in {f.name for f in dataclasses.fields(AWQGPTQScheme)}
    assert AWQGPTQScheme(search="full").awq() == AWQScheme(symmetric=True, search="full", clip=False)
