"""FP8 checkpoint formats and KV-cache scales (packers/codecs/fp8_formats.py, calib/kv_scales.py).

Independent readers: plain `transformers.AutoModelForCausalLM.from_pretrained` (with the
compressed-tensors package for `float-quantized`; transformers' FineGrainedFP8 dequantizer
for native block FP8) and compressed-tensors' own config parser. KV references: the keys
and values transformers' own DynamicCache stores.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from infer_tool.calib.kv_scales import measure_kv_amax
from infer_tool.common.errors import BadInput
from infer_tool.packers.codecs.fp8_formats import (
    block_alignment_notes,
    fp8_state_dict,
    kv_scale_tensors,
    layer_tensors,
    quantization_config,
    read_fp8_layers,
    read_kv_scales,
)
from infer_tool.packers.fp8 import Fp8Scheme, Fp8Weight, quantize_fp8_weight, static_input_scale

ACT_MAX = 3.0  # the static activation abs-max used for every layer in these tests


@pytest.fixture(scope="module")
def tiny() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # K = 160 and N = 160: one full and one partial 128-block along each dimension
    cfg = LlamaConfig(
        hidden_size=160,
        intermediate_size=288,
        num_hidden_layers=2,
        num_attention_heads=5,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=300,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tiny128() -> Any:
    """Dimensions that are multiples of 128 (transformers' native FP8 loader needs them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        vocab_size=300,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(1))


def _quantize(model: Any, scheme: Fp8Scheme) -> dict[str, Fp8Weight]:
    inp = static_input_scale(ACT_MAX) if scheme.activations == "static" else None
    return {
        n: quantize_fp8_weight(m.weight, scheme, name=n, input_scale=inp)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head"
    }


def _write(model: Any, tensors: dict[str, torch.Tensor], qcfg: dict[str, Any], out: Path) -> Path:
    """A checkpoint directory: the model's config.json + our tensors and quantization_config."""
    from safetensors.torch import save_file

    model.config.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _w8a8_reference(model: Any, layers: dict[str, Fp8Weight], scheme: Fp8Scheme) -> Any:
    """Our model: dequantized FP8 weights, and activations quantized to e4m3 in front of
    each quantized linear (per token, scale amax/448, or the static input scale)."""
    ref = copy.deepcopy(model)

    def qdq(module: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        x = args[0]
        if scheme.activations == "static":
            s = torch.tensor(ACT_MAX / 448)
        else:
            s = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 448  # (..., 1)
        return ((x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s,)

    with torch.no_grad():
        for n, w in layers.items():
            ref.get_submodule(n).weight.copy_(w.dequantize())
            ref.get_submodule(n).register_forward_pre_hook(qdq)
    return ref


@pytest.mark.parametrize(
    "granularity,activations", [("tensor", "static"), ("channel", "dynamic"), ("block", "dynamic")]
)
def test_compressed_tensors_checkpoint_loads_in_transformers(
    tiny: Any, ids: torch.Tensor, tmp_path: Path, granularity: str, activations: str
) -> None:
    """Plain transformers (+ compressed-tensors) runs our checkpoint as W8A8 fake-quant:
    its logits match our dequantized weights with e4m3 activation QDQ to 1e-5 of the
    logit range, while they differ from the fp32 model by far more."""
    from transformers import AutoModelForCausalLM

    scheme = Fp8Scheme(granularity=granularity, activations=activations)
    layers = _quantize(tiny, scheme)
    tensors = fp8_state_dict(tiny.state_dict(), layers, "compressed-tensors")
    _write(tiny, tensors, quantization_config(scheme, "compressed-tensors", ["lm_head"]), tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ref = _w8a8_reference(tiny, layers, scheme)
    with torch.no_grad():
        got, want, fp = loaded(ids).logits, ref(ids).logits, tiny(ids).logits
    span = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-5 * span
    assert float((fp - want).abs().max()) > 1e-3 * span  # the comparison can tell FP8 from fp32
    # our reader returns the same bytes and scales
    from safetensors.torch import load_file

    back = read_fp8_layers(
        load_file(str(tmp_path / "model.safetensors")),
        json.loads((tmp_path / "config.json").read_text())["quantization_config"],
    )
    assert set(back) == set(layers)
    for n, w in layers.items():
        assert torch.equal(back[n].weight.view(torch.uint8), w.weight.view(torch.uint8))
        assert torch.equal(back[n].dequantize(), w.dequantize())
        assert (back[n].input_scale is None) == (activations == "dynamic")


def test_compressed_tensors_config_parses_with_its_own_parser() -> None:
    from compressed_tensors.quantization import QuantizationConfig

    for g, a in (("tensor", "static"), ("channel", "dynamic"), ("block", "dynamic")):
        cfg = quantization_config(
            Fp8Scheme(granularity=g, activations=a, kv_cache="fp8"), "compressed-tensors", ["lm_head"]
        )
        parsed = QuantizationConfig.model_validate(cfg)
        w = parsed.config_groups["group_0"].weights
        assert (w.type, w.num_bits, w.strategy, w.dynamic) == ("float", 8, g, False)
        assert parsed.config_groups["group_0"].input_activations.dynamic == (a == "dynamic")
        kv = parsed.kv_cache_scheme
        assert (kv.type, kv.num_bits, kv.strategy, kv.symmetric) == ("float", 8, "tensor", True)
        if g == "block":
            assert w.block_structure == [128, 128]


def test_native_block_tensors_and_alignment_note(tiny: Any) -> None:
    scheme = Fp8Scheme(granularity="block")
    layers = _quantize(tiny, scheme)
    tensors = fp8_state_dict(tiny.state_dict(), layers, "fp8")
    q = tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"]  # N=288, K=160
    assert q.dtype == torch.float32 and q.shape == (3, 2)
    assert "model.layers.0.mlp.gate_proj.weight_scale" not in tensors
    back = read_fp8_layers(tensors, quantization_config(scheme, "fp8", ["lm_head"]))
    n = "model.layers.0.mlp.gate_proj"
    assert torch.equal(back[n].dequantize(), layers[n].dequantize())
    notes = block_alignment_notes({n: w.shape for n, w in layers.items()}, scheme.block_size)
    assert len(notes) == 1 and "gate_proj 288x160" in notes[0]
    assert block_alignment_notes({"a": (256, 384)}, (128, 128)) == []


def test_native_block_checkpoint_loads_in_transformers(tiny128: Any, ids: torch.Tensor, tmp_path: Path) -> None:
    """transformers' FineGrainedFP8 (no GPU: dequantizes on load) reads our native block
    checkpoint; weight-only comparison, same 1e-5 tolerance."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tiny = tiny128
    scheme = Fp8Scheme(granularity="block")
    layers = _quantize(tiny, scheme)
    tensors = fp8_state_dict(tiny.state_dict(), layers, "fp8")
    qcfg = quantization_config(scheme, "fp8", ["lm_head"])
    assert qcfg["weight_block_size"] == [128, 128] and qcfg["activation_scheme"] == "dynamic"
    _write(tiny, tensors, qcfg, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ref = copy.deepcopy(tiny)
    with torch.no_grad():
        for n, w in layers.items():
            ref.get_submodule(n).weight.copy_(w.dequantize())
        got, want = loaded(ids).logits, ref(ids).logits
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    back = read_fp8_layers(load_file(str(tmp_path / "model.safetensors")), qcfg)
    n = "model.layers.0.self_attn.o_proj"
    assert back[n].granularity == "block" and torch.equal(back[n].dequantize(), layers[n].dequantize())


def test_native_per_tensor_names_and_refusals(tiny: Any) -> None:
    scheme = Fp8Scheme(granularity="tensor", activations="static")
    layers = _quantize(tiny, scheme)
    t = layer_tensors("model.layers.0.self_attn.q_proj", layers["model.layers.0.self_attn.q_proj"], "fp8")
    assert t["model.layers.0.self_attn.q_proj.weight_scale"].shape == ()
    assert float(t["model.layers.0.self_attn.q_proj.input_scale"]) == pytest.approx(ACT_MAX / 448)
    cfg = quantization_config(scheme, "fp8", ["lm_head"])
    assert cfg == {
        "quant_method": "fp8",
        "activation_scheme": "static",
        "weight_block_size": None,
        "ignored_layers": ["lm_head"],
    }
    back = read_fp8_layers(fp8_state_dict(tiny.state_dict(), layers, "fp8"), cfg)
    assert torch.equal(
        back["model.layers.1.mlp.down_proj"].dequantize(), layers["model.layers.1.mlp.down_proj"].dequantize()
    )
    with pytest.raises(BadInput, match="only by --format compressed-tensors"):
        quantization_config(Fp8Scheme(granularity="channel"), "fp8", [])
    with pytest.raises(BadInput, match="compressed-tensors, fp8"):
        quantization_config(Fp8Scheme(), "awq", [])


def test_kv_amax_is_what_the_cache_stores_after_rope(tiny: Any, ids: torch.Tensor) -> None:
    """Reference: the keys/values transformers' DynamicCache holds after a forward."""
    kv = measure_kv_amax(tiny, ids, batch_size=2)
    assert list(kv) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    with torch.no_grad():
        cache = tiny(ids, use_cache=True).past_key_values
        k0 = tiny.model.layers[0].self_attn.k_proj(tiny.model.layers[0].input_layernorm(tiny.model.embed_tokens(ids)))
    for i, layer in enumerate(cache.layers):
        a = kv[f"model.layers.{i}.self_attn"]
        assert a.k_amax == pytest.approx(float(layer.keys.abs().max()), rel=1e-6)
        assert a.v_amax == pytest.approx(float(layer.values.abs().max()), rel=1e-6)
        assert a.tokens == ids.numel()
    # keys are measured after the rotary embedding, not at the k_proj output
    assert abs(kv["model.layers.0.self_attn"].k_amax - float(k0.abs().max())) > 1e-4
    t = kv_scale_tensors(kv, "compressed-tensors")
    assert t["model.layers.1.self_attn.v_scale"].shape == (1,)
    assert float(t["model.layers.1.self_attn.v_scale"]) == pytest.approx(kv["model.layers.1.self_attn"].v_amax / 448)
    native = kv_scale_tensors(kv, "fp8")
    assert native["model.layers.0.self_attn.k_scale"].shape == ()
    back = read_kv_scales(native)
    assert back["model.layers.0.self_attn"][0] == pytest.approx(kv["model.layers.0.self_attn"].k_amax / 448)


def test_simulated_fp8_kv_cache_stores_e4m3_rounded_keys(tiny: Any, ids: torch.Tensor) -> None:
    """With the simulation on, the cache holds layer 0's keys / values rounded through
    e4m3 at the given scales (layer 0's inputs do not depend on the rounding)."""
    from infer_tool.calib.kv_scales import simulating_fp8_kv

    kv = measure_kv_amax(tiny, ids)
    scales = {n: (a.k_amax / 448, a.v_amax / 448) for n, a in kv.items()}
    with torch.no_grad():
        fp = tiny(ids, use_cache=True)
        with simulating_fp8_kv(tiny, scales):
            sim = tiny(ids, use_cache=True)
    k_s, v_s = scales["model.layers.0.self_attn"]
    k_fp, v_fp = fp.past_key_values.layers[0].keys, fp.past_key_values.layers[0].values
    assert torch.equal(sim.past_key_values.layers[0].keys, (k_fp / k_s).to(torch.float8_e4m3fn).float() * k_s)
    assert torch.equal(sim.past_key_values.layers[0].values, (v_fp / v_s).to(torch.float8_e4m3fn).float() * v_s)
    d = float((sim.logits - fp.logits).abs().max())
    assert 0 < d < 0.1 * float(fp.logits.abs().max())
