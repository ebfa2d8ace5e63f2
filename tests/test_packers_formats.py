"""The three INT4 formats and `write_checkpoint` / `read_checkpoint`.

Each format's tensors are unpacked by a reference written here from the format's
definition (DESIGN.md §3; AutoAWQ WQLinear_GEMM; GPTQ v1) with plain per-nibble loops, and
compressed-tensors checkpoints are read by the `compressed-tensors` package itself
(through plain transformers for symmetric schemes)."""

import copy
import hashlib
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from infer_tool.common.errors import BadInput
from infer_tool.packers import checkpoint
from infer_tool.packers.checkpoint import CheckpointFormat, get_format, read_checkpoint, write_checkpoint
from infer_tool.packers.codecs import awq_gemm, compressed_tensors, gptq_v1
from infer_tool.packers.gptq import quantize_gptq
from infer_tool.packers.int_weight import QuantizedWeight
from infer_tool.packers.rtn import quantize_rtn
from infer_tool.schemes.integer import GPTQScheme, RTNScheme

AWQ_NIBBLE_TO_COLUMN = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column order[i]


def _nibble(word: int, i: int) -> int:
    return ((word & 0xFFFFFFFF) >> (4 * i)) & 0xF


def _random_qw(n=16, k=64, g=32, symmetric=False, seed=0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    return QuantizedWeight(
        q=torch.randint(0, 16, (n, k), generator=gen).to(torch.uint8),
        scale=torch.rand(n, k // g, generator=gen) * 0.1 + 0.01,
        zero=None if symmetric else torch.randint(0, 16, (n, k // g), generator=gen).to(torch.uint8),
        g_idx=None,
        bits=4,
        group_size=g,
    )


# ---------------------------------------------------------------- tensors, bit for bit


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_layout(symmetric):
    qw = _random_qw(symmetric=symmetric)
    t = compressed_tensors.layer_tensors("l", qw, torch.float32)
    wp = t["l.weight_packed"].tolist()  # (N, K/8): element k of row n in word k//8 at nibble k%8
    assert t["l.weight_packed"].shape == (16, 8) and t["l.weight_packed"].dtype == torch.int32
    for n in range(16):
        for k in range(64):
            assert _nibble(wp[n][k // 8], k % 8) == qw.q[n, k]  # stored signed+8 == unsigned code
    assert t["l.weight_shape"].tolist() == [16, 64] and t["l.weight_shape"].dtype == torch.int64
    assert torch.equal(t["l.weight_scale"], qw.scale)
    if symmetric:
        assert "l.weight_zero_point" not in t
    else:
        zp = t["l.weight_zero_point"].tolist()  # (N/8, G): packed along dim 0
        assert t["l.weight_zero_point"].shape == (2, 2)
        for n in range(16):
            for j in range(2):
                assert _nibble(zp[n // 8][j], n % 8) == qw.zero[n, j]


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_decompressor_reads_our_tensors(symmetric):
    """compressed-tensors' own PackedQuantizationCompressor dequantizes our tensors to ours."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    qw = _random_qw(symmetric=symmetric, seed=1)
    cfg = compressed_tensors.quantization_config(RTNScheme(group_size=32, symmetric=symmetric), [])
    scheme = QuantizationScheme(
        targets=["Linear"], **{k: v for k, v in cfg["config_groups"]["group_0"].items() if k != "targets"}
    )
    t = compressed_tensors.layer_tensors("l", qw, torch.float32)
    local = {k.split(".", 1)[1]: v for k, v in t.items()}
    out = PackedQuantizationCompressor.decompress(local, scheme)
    torch.testing.assert_close(out["weight"], qw.dequantize(), rtol=0, atol=1e-6)


def test_awq_gemm_layout():
    qw = _random_qw(n=16, k=64, g=32, seed=2)
    t = awq_gemm.layer_tensors("l", qw, torch.float32)
    qweight, qzeros, scales = t["l.qweight"], t["l.qzeros"], t["l.scales"]
    assert qweight.shape == (64, 2) and qzeros.shape == (2, 2) and scales.shape == (2, 16)
    assert scales.dtype == torch.float16
    qw_l, qz_l = qweight.tolist(), qzeros.tolist()
    for k in range(64):
        for j in range(2):
            for i in range(8):
                n = 8 * j + AWQ_NIBBLE_TO_COLUMN[i]
                assert _nibble(qw_l[k][j], i) == qw.q[n, k]
    for gi in range(2):
        for j in range(2):
            for i in range(8):
                n = 8 * j + AWQ_NIBBLE_TO_COLUMN[i]
                assert _nibble(qz_l[gi][j], i) == qw.zero[n, gi]  # unsigned, no offset
    # reference dequantization from the unpacked fields
    W = torch.empty(16, 64)
    for n in range(16):
        for k in range(64):
            j, i = n // 8, AWQ_NIBBLE_TO_COLUMN.index(n % 8)
            W[n, k] = (_nibble(qw_l[k][j], i) - _nibble(qz_l[k // 32][j], i)) * float(scales[k // 32, n])
    torch.testing.assert_close(W, qw.dequantize(), rtol=1e-3, atol=1e-4)  # fp16 scales


def test_gptq_v1_layout():
    qw = _random_qw(n=16, k=64, g=32, symmetric=True, seed=3)
    t = gptq_v1.layer_tensors("l", qw, torch.float32)
    qweight, qzeros, g_idx = t["l.qweight"], t["l.qzeros"], t["l.g_idx"]
    assert qweight.shape == (8, 16) and qzeros.shape == (2, 2) and t["l.scales"].shape == (2, 16)
    assert g_idx.dtype == torch.int32 and g_idx.tolist() == [k // 32 for k in range(64)]
    qw_l, qz_l = qweight.tolist(), qzeros.tolist()
    for k in range(64):
        for n in range(16):
            assert _nibble(qw_l[k // 8][n], k % 8) == qw.q[n, k]  # packed along K, sequential
    for gi in range(2):
        for n in range(16):
            assert _nibble(qz_l[gi][n // 8], n % 8) + 1 == 8  # zero minus one
    W = torch.empty(16, 64)
    for n in range(16):
        for k in range(64):
            gi = g_idx[k]
            W[n, k] = (_nibble(qw_l[k // 8][n], k % 8) - (_nibble(qz_l[gi][n // 8], n % 8) + 1)) * float(
                t["l.scales"][gi, n]
            )
    torch.testing.assert_close(W, qw.dequantize(), rtol=1e-3, atol=1e-4)


def test_gptq_v1_carries_dynamic_act_order_g_idx():
    gen = torch.Generator().manual_seed(4)
    W = torch.randn(16, 64, generator=gen)
    X = torch.randn(256, 64, generator=gen) * torch.exp(torch.randn(64, generator=gen))
    qw = quantize_gptq(W, 2 * X.T @ X / 256, GPTQScheme(group_size=32, act_order=True, static_groups=False))
    t = gptq_v1.layer_tensors("l", qw, torch.float32)
    assert torch.equal(t["l.g_idx"], qw.g_idx)
    back = gptq_v1.read_layers(
        t, gptq_v1.quantization_config(GPTQScheme(group_size=32, act_order=True, static_groups=False), [])
    )["l"]
    assert torch.equal(back.q, qw.q) and torch.equal(back.g_idx, qw.g_idx)
    with pytest.raises(BadInput):
        compressed_tensors.check(GPTQScheme(group_size=32, act_order=True, static_groups=False), {"l": qw})
    with pytest.raises(BadInput):
        awq_gemm.check(GPTQScheme(group_size=32, act_order=True, static_groups=False), {"l": qw})


# ---------------------------------------------------------------- checkpoints


def _tiny_llama(tied: bool, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(cfg).eval()


def _quantize_all(model, scheme) -> dict[str, QuantizedWeight]:
    return {
        n: quantize_rtn(m.weight.data, None, scheme)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head"
    }


def _dequantized_copy(model, quantized):
    ref = copy.deepcopy(model)
    for n, qw in quantized.items():
        ref.get_submodule(n).weight.data = qw.dequantize(ref.get_submodule(n).weight.dtype)
    return ref


@pytest.mark.parametrize("tied", [True, False])
def test_compressed_tensors_checkpoint_loads_in_plain_transformers(tmp_path, tied):
    """Tolerance: logits within 1e-5 (fp32 model, fp32 scales: the same arithmetic)."""
    model = _tiny_llama(tied)
    scheme = RTNScheme(group_size=32, symmetric=True)
    quantized = _quantize_all(model, scheme)
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text('{"fake": true}')
    (src / "chat_template.jinja").write_text("{{ messages }}")
    out = write_checkpoint(model, quantized, "compressed-tensors", scheme, tmp_path / "ck", src_dir=src)
    assert (out / "tokenizer.json").read_text() == '{"fake": true}' and (out / "chat_template.jinja").exists()
    assert (out / "generation_config.json").exists()
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) == (not tied)
    assert "model.layers.0.self_attn.q_proj.weight" not in keys

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ref = _dequantized_copy(model, quantized)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)
    if tied:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    else:
        assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize(
    "fmt,symmetric", [("compressed-tensors", False), ("compressed-tensors", True), ("awq", False), ("gptq", True)]
)
def test_read_checkpoint_round_trip(tmp_path, fmt, symmetric):
    model = _tiny_llama(tied=True, seed=1).to(torch.bfloat16)
    scheme = GPTQScheme(group_size=32, symmetric=symmetric, act_order=True)
    quantized = _quantize_all(model, scheme)
    out = write_checkpoint(model, quantized, fmt, scheme, tmp_path / "ck")
    config, layers, rest = read_checkpoint(out)
    assert config["quantization_config"] == get_format(fmt).config(scheme, ["lm_head"])
    assert set(layers) == set(quantized)
    for name, qw in quantized.items():
        back = layers[name]
        assert torch.equal(back.q, qw.q)
        assert torch.equal(back.zero_points(), qw.zero_points())
        assert back.group_size == 32 and back.has_trivial_g_idx()
        stored = torch.bfloat16 if fmt == "compressed-tensors" else torch.float16  # scale storage dtype
        assert torch.equal(back.scale, qw.scale.to(stored).float())
    assert "lm_head.weight" not in rest  # tied: not written
    assert config["dtype"] == "bfloat16"
    assert rest["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(rest["model.embed_tokens.weight"], model.model.embed_tokens.weight)


def test_sharded_checkpoint_reads_back(tmp_path):
    model = _tiny_llama(tied=False, seed=2)
    scheme = RTNScheme(group_size=32, symmetric=False)
    quantized = _quantize_all(model, scheme)
    out = write_checkpoint(model, quantized, "awq", scheme, tmp_path / "ck", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _, layers, rest = read_checkpoint(out)
    assert set(layers) == set(quantized) and "lm_head.weight" in rest


def test_gptq_format_refuses_asymmetric(tmp_path):
    model = _tiny_llama(tied=True)
    scheme = RTNScheme(group_size=32, symmetric=False)
    with pytest.raises(BadInput, match="--format awq or --format compressed-tensors"):
        write_checkpoint(model, _quantize_all(model, scheme), "gptq", scheme, tmp_path / "ck")
    assert os.listdir(tmp_path) == []
    with pytest.raises(BadInput, match="compressed-tensors"):
        write_checkpoint(model, {}, "nope", scheme, tmp_path / "ck")


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_deterministic_bytes(tmp_path):
    scheme = GPTQScheme(group_size=32, symmetric=False)
    digests = []
    for i in range(2):
        model = _tiny_llama(tied=True, seed=3)
        out = write_checkpoint(model, _quantize_all(model, scheme), "compressed-tensors", scheme, tmp_path / f"ck{i}")
        digests.append((_digest(out / "model.safetensors"), _digest(out / "config.json")))
    assert digests[0] == digests[1]


def test_existing_dir_refused_then_overwritten(tmp_path):
    """An existing --out is refused; --overwrite replaces only one of our checkpoints (it
    holds quantize_report.json), never a directory of someone else's files."""
    model = _tiny_llama(tied=True)
    scheme = RTNScheme(group_size=32)
    out = tmp_path / "ck"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(BadInput, match="already exists"):
        write_checkpoint(model, _quantize_all(model, scheme), "compressed-tensors", scheme, out)
    with pytest.raises(BadInput, match="did not write"):
        write_checkpoint(model, _quantize_all(model, scheme), "compressed-tensors", scheme, out, overwrite=True)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    write_checkpoint(
        model,
        _quantize_all(model, scheme),
        "compressed-tensors",
        scheme,
        out,
        overwrite=True,
        extra_files={"quantize_report.json": "{}"},
    )
    write_checkpoint(
        model,
        _quantize_all(model, scheme),
        "compressed-tensors",
        scheme,
        out,
        overwrite=True,
        extra_files={"quantize_report.json": '{"second": 1}'},
    )
    assert (out / "quantize_report.json").read_text() == '{"second": 1}'
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_atomic_write_leaves_nothing_on_failure(tmp_path, monkeypatch):
    """A failure after part of the weights hit the disk leaves neither out_dir nor a temp dir."""
    from infer_tool.packers import safetensors_stream

    real = safetensors_stream.tensor_bytes
    written = []

    def two_then_fail(t):
        if len(written) == 2:
            raise OSError("disk full (simulated)")
        written.append(t)
        return real(t)

    monkeypatch.setattr(safetensors_stream, "tensor_bytes", two_then_fail)
    model = _tiny_llama(tied=True)
    scheme = RTNScheme(group_size=32)
    with pytest.raises(OSError, match="simulated"):
        write_checkpoint(model, _quantize_all(model, scheme), "compressed-tensors", scheme, tmp_path / "ck")
    assert len(written) == 2
    assert os.listdir(tmp_path) == []


def test_registry_plugs_in_a_format_and_casts_dtype(tmp_path, monkeypatch):
    """A format registered with one call is written and read back by name; dtype= casts the
    unquantized tensors and is recorded in config.json."""
    monkeypatch.setattr(checkpoint, "_REGISTERED", {})
    plain = CheckpointFormat(
        name="plain",
        kind="int",
        suffixes=("weight",),
        config=lambda scheme, ignore: {"quant_method": "plain-test", "ignore": list(ignore)},
        tensors=lambda name, qw, dtype: {f"{name}.weight": qw.dequantize(dtype)},
        read=lambda tensors, cfg: {k[: -len(".weight")]: tensors[k] for k in tensors if "proj" in k},
        matches=lambda cfg: cfg.get("quant_method") == "plain-test",
    )
    checkpoint.register_format(plain)
    model = _tiny_llama(tied=True)
    scheme = RTNScheme(group_size=32)
    quantized = _quantize_all(model, scheme)
    out = write_checkpoint(model, quantized, "plain", scheme, tmp_path / "ck", dtype=torch.float16)
    config, layers, rest = read_checkpoint(out)
    assert config["dtype"] == "float16" and rest["model.norm.weight"].dtype == torch.float16
    name = "model.layers.1.mlp.down_proj"
    assert torch.equal(layers[name], quantized[name].dequantize(torch.float16))
    with pytest.raises(BadInput, match="plain"):
        get_format("nope")
