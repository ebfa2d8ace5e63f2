"""The mixed-precision checkpoint (packers/codecs/mixed_precision.py): each linear's tensors are exactly
those a uniform run of its scheme writes for it (the oracle: `calib.pipeline.quantize_model` +
`write_checkpoint` of that scheme alone), the config has one group per scheme with its own
format, our reader and transformers + compressed-tensors read it back."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from tiny import save_tiny_llama  # noqa: E402

from infer_tool.calib.mixed_candidates import parse_candidate  # noqa: E402
from infer_tool.calib.mixed_sensitivity import solved  # noqa: E402
from infer_tool.packers.checkpoint import all_formats, read_checkpoint, write_checkpoint  # noqa: E402
from infer_tool.packers.codecs.mixed_precision import SUFFIXES, write_mixed  # noqa: E402

# a plan by hand over a 2-layer tiny Llama: every fused unit (q/k/v, gate/up) shares its scheme
PLAN = {
    "model.layers.0.self_attn.q_proj": "W4A16",
    "model.layers.0.self_attn.k_proj": "W4A16",
    "model.layers.0.self_attn.v_proj": "W4A16",
    "model.layers.0.self_attn.o_proj": "FP8",
    "model.layers.0.mlp.gate_proj": "NVFP4A16",
    "model.layers.0.mlp.up_proj": "NVFP4A16",
    "model.layers.0.mlp.down_proj": "NONE",
    "model.layers.1.self_attn.q_proj": "W8A16",
    "model.layers.1.self_attn.k_proj": "W8A16",
    "model.layers.1.self_attn.v_proj": "W8A16",
    "model.layers.1.self_attn.o_proj": "W4A16_ASYM",
    "model.layers.1.mlp.gate_proj": "W4A16_FULL",
    "model.layers.1.mlp.up_proj": "W4A16_FULL",
    "model.layers.1.mlp.down_proj": "MXFP4A16",
}
FUSED = [
    (f"model.layers.{i}.{p}", tuple(f"model.layers.{i}.{p}.{s}" for s in shards))
    for i in range(2)
    for p, shards in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
]


def tiny_bf16() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def mixed_weights(model: Any, plan: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """({linear: weight}, {linear: scheme}) of `plan`, solved unit by unit as the writer's job does."""
    units = [shards for _, shards in FUSED] + [(n,) for n in plan if not any(n in s for _, s in FUSED)]
    quantized, schemes = {}, {}
    for names in units:
        cand = parse_candidate(plan[names[0]])
        if cand.scheme is None:
            continue
        scheme = cand.scheme.for_storage("bfloat16")
        cand = type(cand)(cand.name, scheme)
        ws = [model.get_submodule(n).weight.detach() for n in names]
        for n, w in zip(names, solved(cand, ws, names)):
            quantized[n], schemes[n] = w, scheme
    return quantized, schemes


@pytest.mark.slow  # six uniform quantize + write runs of a tiny model
def test_each_linear_is_what_a_uniform_run_of_its_scheme_writes(tmp_path: Path) -> None:
    from infer_tool.calib.pipeline import quantize_model

    model = tiny_bf16()
    quantized, schemes = mixed_weights(model, PLAN)
    out = write_mixed(model, quantized, schemes, tmp_path / "mixed", dtype=torch.bfloat16)
    mixed = load_file(str(out / "model.safetensors"))
    checked = set()
    for name in sorted({v for v in PLAN.values() if v != "NONE"}):
        scheme = parse_candidate(name).scheme.for_storage("bfloat16")
        uniform_model = tiny_bf16()
        result = quantize_model(uniform_model, None, scheme)
        u = write_checkpoint(
            uniform_model, result.quantized, "compressed-tensors", scheme, tmp_path / name, dtype=torch.bfloat16
        )
        uniform = load_file(str(u / "model.safetensors"))
        for linear in [n for n, c in PLAN.items() if c == name]:
            keys = sorted(k for k in mixed if k.rpartition(".")[0] == linear)
            assert keys == sorted(k for k in uniform if k.rpartition(".")[0] == linear), linear
            for k in keys:
                assert mixed[k].dtype == uniform[k].dtype and torch.equal(mixed[k], uniform[k]), k
            checked.add(linear)
    assert checked == {n for n, c in PLAN.items() if c != "NONE"}
    # unquantized: the weight as the model holds it; everything outside the linears as a uniform checkpoint has it
    assert torch.equal(mixed["model.layers.0.mlp.down_proj.weight"], model.model.layers[0].mlp.down_proj.weight)
    others = [k for k in uniform if not any(k.startswith(f"{n}.") for n in PLAN)]
    assert others and all(torch.equal(mixed[k], uniform[k]) for k in others)


def test_config_has_one_group_per_scheme_with_its_format(tmp_path: Path) -> None:
    model = tiny_bf16()
    quantized, schemes = mixed_weights(model, PLAN)
    out = write_mixed(model, quantized, schemes, tmp_path / "mixed", dtype=torch.bfloat16)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mixed-precision"
    groups = list(qc["config_groups"].values())
    assert len(groups) == 6  # W4A16, W4A16_ASYM, W8A16, FP8, NVFP4A16, MXFP4A16
    targets = sorted(t for g in groups for t in g["targets"])
    assert targets == sorted(n for n, c in PLAN.items() if c != "NONE")
    by_format = {}
    for g in groups:
        by_format.setdefault(g["format"], []).append(g)
    assert sorted(by_format) == ["float-quantized", "mxfp4-pack-quantized", "nvfp4-pack-quantized", "pack-quantized"]
    assert len(by_format["pack-quantized"]) == 3
    (fp8,) = by_format["float-quantized"]
    assert fp8["targets"] == ["model.layers.0.self_attn.o_proj"] and fp8["input_activations"]["dynamic"] is True
    assert qc["ignore"] == ["lm_head", "model.layers.0.mlp.down_proj"]
    # vLLM's rule: the shards of one fused linear are in one group
    for _, shards in FUSED:
        assert len({i for i, g in enumerate(groups) for s in shards if s in g["targets"]}) == 1


def test_reads_back_as_written(tmp_path: Path) -> None:
    from infer_tool.packers.checkpoint import format_of

    model = tiny_bf16()
    quantized, schemes = mixed_weights(model, PLAN)
    out = write_mixed(model, quantized, schemes, tmp_path / "mixed", dtype=torch.bfloat16)
    config, layers, rest = read_checkpoint(out)
    assert format_of(config["quantization_config"]).kind == "mixed"
    assert sorted(layers) == sorted(quantized)
    for n, w in layers.items():
        assert type(w) is type(quantized[n]), n
        assert torch.equal(w.dequantize(torch.float32), quantized[n].dequantize(torch.float32)), n
    assert "model.layers.0.mlp.down_proj.weight" in rest
    assert not any(k.rpartition(".")[0] in layers for k in rest if not k.endswith(".bias"))


def test_suffixes_cover_every_compressed_tensors_codec() -> None:
    ct = {s for f in all_formats() if f.name == "compressed-tensors" and f.kind != "mixed" for s in f.suffixes}
    assert ct <= set(SUFFIXES)


@pytest.mark.slow  # transformers + compressed-tensors load a checkpoint
def test_transformers_with_compressed_tensors_reads_an_int4_int8_nvfp4_mix(tmp_path: Path) -> None:
    """transformers decompresses the mixed checkpoint with compressed-tensors' own readers, group
    by group; its logits equal a model holding our dequantized weights (bfloat16, the dtype its
    FP4 decompression writes: to 1e-2 of the largest logit; FP8 is left out, compressed-tensors
    runs it with FP8 activations)."""
    from transformers import AutoModelForCausalLM

    tiny = save_tiny_llama(tmp_path / "tiny", tie=False)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16).eval()
    plan = {
        n.replace("model.layers.0.", f"model.layers.{i}."): c
        for i in range(2)
        for n, c in PLAN.items()
        if "layers.0" in n
    }
    plan["model.layers.0.self_attn.o_proj"] = "W8A16"
    plan["model.layers.1.self_attn.o_proj"] = "NONE"
    plan["model.layers.1.mlp.down_proj"] = "MXFP4A16"
    plan["model.layers.1.mlp.gate_proj"] = plan["model.layers.1.mlp.up_proj"] = "W4A16_FULL"  # signed scales
    plan = {n: c.replace("W4A16", "W4A16_G32").replace("W8A16", "W8A16_G32") for n, c in plan.items()}
    quantized, schemes = mixed_weights(model, plan)
    out = write_mixed(model, quantized, schemes, tmp_path / "mixed", src_dir=tiny, dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    ref = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16).eval()
    for n, w in quantized.items():
        ref.get_submodule(n).weight.data = w.dequantize(torch.bfloat16)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = hf(ids).logits.float(), ref(ids).logits.float()
        c = model(ids).logits.float()
    assert float((a - b).abs().max()) <= 1e-2 * float(b.abs().max())
    assert float((a - c).abs().max()) > 3e-2 * float(c.abs().max())  # and the weights were quantized


def test_a_group_without_its_format_is_refused_naming_it(tmp_path: Path) -> None:
    from infer_tool.common.errors import BadInput

    model = tiny_bf16()
    quantized, schemes = mixed_weights(model, PLAN)
    out = write_mixed(model, quantized, schemes, tmp_path / "mixed", dtype=torch.bfloat16)
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]["config_groups"]["group_0"]["format"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BadInput, match="has format None; each group needs its own"):
        read_checkpoint(out)


def test_a_failed_overwrite_leaves_the_earlier_checkpoint_as_it_was(tmp_path: Path, monkeypatch) -> None:
    """A failure after part of the weights hit the disk, while replacing our own earlier checkpoint
    (--overwrite), leaves that checkpoint byte for byte and no temporary directory beside it."""
    from infer_tool.packers import safetensors_stream

    model = tiny_bf16()
    quantized, schemes = mixed_weights(model, PLAN)
    out = write_mixed(model, quantized, schemes, tmp_path / "mixed", dtype=torch.bfloat16)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real, written = safetensors_stream.tensor_bytes, []

    def two_then_fail(t):  # noqa: ANN001, ANN202
        if len(written) == 2:
            raise OSError("disk full (simulated)")
        written.append(t)
        return real(t)

    monkeypatch.setattr(safetensors_stream, "tensor_bytes", two_then_fail)
    with pytest.raises(OSError, match="simulated"):
        write_mixed(model, quantized, schemes, out, overwrite=True, dtype=torch.bfloat16)
    assert len(written) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixed"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
