"""FP8 through the calibration pipeline and the checkpoint registry (calib/quantizers/fp8.py,
packers/codecs/fp8_formats.py registered in packers/checkpoint.py).

Independent references: statistics re-measured with plain forward hooks / a whole-model
KV recording on the final (FP8-weight) model, and the checkpoint read back by our reader.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from infer_tool.calib.kv_scales import measure_kv_amax
from infer_tool.calib.pipeline import quantize_model
from infer_tool.common.errors import BadInput
from infer_tool.packers.checkpoint import read_checkpoint, write_checkpoint
from infer_tool.packers.codecs.fp8_formats import kv_scale_tensors, read_kv_scales
from infer_tool.packers.fp8 import Fp8Weight
from infer_tool.schemes.fp8 import Fp8Scheme


@pytest.fixture(scope="module")
def model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=200,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 200, (6, 32), generator=torch.Generator().manual_seed(2))


DECODER_LINEARS = 2 * 7


def quantize_model_fp8(model: Any, ids: torch.Tensor, scheme: Fp8Scheme, **kw: Any) -> tuple[Any, dict[str, Any]]:
    """The pipeline's result and its KV-cache amax per attention layer."""
    result = quantize_model(model, ids, scheme, **kw)
    return result, dict(result.kv_amax)


def test_static_activations_and_kv_scales_match_a_plain_rerun(model: Any, ids: torch.Tensor) -> None:
    m = copy.deepcopy(model)
    scheme = Fp8Scheme(granularity="tensor", activations="static", kv_cache="fp8")
    result, kv = quantize_model_fp8(m, ids, scheme, device="cpu", batch_size=4)
    assert len(result.quantized) == DECODER_LINEARS and all(isinstance(w, Fp8Weight) for w in result.quantized.values())
    assert "lm_head" not in result.quantized
    # the model's weights are now the dequantized FP8 values
    for name, w in result.quantized.items():
        assert torch.equal(m.get_submodule(name).weight, w.dequantize())
    # q/k/v inputs do not depend on their own layer's weights: re-measure them on the final model
    seen: dict[str, float] = {}
    hooks = [
        m.get_submodule(f"model.layers.{i}.self_attn.q_proj").register_forward_pre_hook(
            lambda mod, args, i=i: seen.__setitem__(i, max(seen.get(i, 0.0), float(args[0].abs().max())))
        )
        for i in range(2)
    ]
    with torch.no_grad():
        m(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    for i in range(2):
        for p in ("q_proj", "k_proj", "v_proj"):
            got = float(result.quantized[f"model.layers.{i}.self_attn.{p}"].input_scale)
            assert got == pytest.approx(seen[i] / 448, rel=1e-5)
    # KV amax measured layer by layer equals a whole-model recording on the final model
    ref = measure_kv_amax(m, ids)
    assert set(kv) == set(ref) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    for name in ref:
        assert kv[name].k_amax == pytest.approx(ref[name].k_amax, rel=1e-5)
        assert kv[name].v_amax == pytest.approx(ref[name].v_amax, rel=1e-5)
        assert kv[name].tokens == ids.numel()


@pytest.mark.parametrize("fmt,granularity", [("compressed-tensors", "channel"), ("fp8", "block")])
def test_write_and_read_back_through_the_registry(
    model: Any, ids: torch.Tensor, tmp_path: Path, fmt: str, granularity: str
) -> None:
    m = copy.deepcopy(model)
    scheme = Fp8Scheme(granularity=granularity, kv_cache="fp8", clip_search=True, clip_steps=4)
    result, kv = quantize_model_fp8(m, ids, scheme, device="cpu", ignore=("mlp.down_proj",))
    assert not any("down_proj" in n for n in result.quantized)
    assert all("clip_ratio_mean" in w.info and w.info["clip_loss_ratio"] <= 1.0 for w in result.quantized.values())
    out = write_checkpoint(m, result.quantized, fmt, scheme, tmp_path / "ckpt", extra_tensors=kv_scale_tensors(kv, fmt))
    config, layers, rest = read_checkpoint(out)
    qcfg = config["quantization_config"]
    assert qcfg["quant_method"] == ("compressed-tensors" if fmt == "compressed-tensors" else "fp8")
    assert "model.layers.0.mlp.down_proj" in qcfg.get("ignore", qcfg.get("ignored_layers"))
    assert set(layers) == set(result.quantized)
    for name, w in layers.items():
        assert torch.equal(w.dequantize(), result.quantized[name].dequantize())
    scales = read_kv_scales(rest)
    assert scales["model.layers.1.self_attn"][1] == pytest.approx(kv["model.layers.1.self_attn"].v_amax / 448)
    assert rest["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32  # ignored layer stays unquantized
    if fmt == "compressed-tensors":
        assert qcfg["kv_cache_scheme"]["type"] == "float"


def test_per_channel_native_refused_before_writing(model: Any, ids: torch.Tensor, tmp_path: Path) -> None:
    m = copy.deepcopy(model)
    scheme = Fp8Scheme(granularity="channel")
    result, _ = quantize_model_fp8(m, ids[:2], scheme, device="cpu")
    with pytest.raises(BadInput, match="compressed-tensors"):
        write_checkpoint(m, result.quantized, "fp8", scheme, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_nan_weight_refused_naming_the_tensor(model: Any, ids: torch.Tensor) -> None:
    m = copy.deepcopy(model)
    with torch.no_grad():
        m.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(BadInput, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        quantize_model_fp8(m, ids[:2], Fp8Scheme(), device="cpu")


def test_fp8_runtime_runs_w8a8_and_restores(model: Any, ids: torch.Tensor) -> None:
    """Inside `fp8_runtime` the model runs W8A8 (reference: dequantized weights with e4m3
    per-token activation QDQ hooks; tolerance 1e-4 of the logit range, fp32 summation
    order differs), with the KV cache rounded when scales are given; outside, the plain
    dequantized model is back."""
    from infer_tool.formats.fp8.deployed import fp8_runtime

    m = copy.deepcopy(model)
    result, kv = quantize_model_fp8(m, ids[:2], Fp8Scheme(granularity="channel", kv_cache="fp8"), device="cpu")
    ref = copy.deepcopy(m)

    def qdq(module: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        s = args[0].abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 448
        return ((args[0] / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s,)

    for name in result.quantized:
        ref.get_submodule(name).register_forward_pre_hook(qdq)
    with torch.no_grad():
        plain = m(ids).logits
        want = ref(ids).logits
        with fp8_runtime(m, result.quantized):
            got = m(ids).logits
        scales = {n: (a.k_amax / 448, a.v_amax / 448) for n, a in kv.items()}
        with fp8_runtime(m, result.quantized, scales):
            got_kv = m(ids).logits
        again = m(ids).logits
    span = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-4 * span
    assert float((got - plain).abs().max()) > 1e-3 * span  # activation rounding is visible
    assert 0 < float((got_kv - got).abs().max()) < 0.1 * span  # so is the KV rounding, mildly
    assert torch.equal(again, plain)
    assert all(type(m.get_submodule(n)) is torch.nn.Linear for n in result.quantized)
