"""Bits per weight as stored (calib/mixed_bits.py) against the oracle: the bytes of the
tensors our compressed-tensors writers write for a tiny bfloat16 Llama quantized with each
candidate (read from the safetensors header), linear by linear; and the candidate names."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from infer_tool.calib.mixed_bits import bits_per_weight, stored_bytes
from infer_tool.calib.mixed_candidates import parse_candidate, parse_candidates
from infer_tool.calib.pipeline import quantize_model
from infer_tool.common.errors import BadInput
from infer_tool.packers.checkpoint import write_checkpoint


def tiny_bf16() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def header_bytes(path: Path) -> dict[str, int]:
    """{tensor name: stored bytes} from a safetensors file's header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


@pytest.mark.parametrize(
    "name", ["W4A16", "W4A16_ASYM", "W4A16_G32", "W8A16", "FP8", "FP8_BLOCK", "NVFP4A16", "MXFP4A16"]
)
def test_stored_bytes_are_the_writers_bytes(name: str, tmp_path: Path) -> None:
    model = tiny_bf16()
    cand = parse_candidate(name)
    scheme = cand.scheme.for_storage("bfloat16")
    result = quantize_model(model, None, scheme)
    left_out = "model.layers.0.mlp.down_proj"  # written unquantized: the NONE candidate's size
    quantized = {n: w for n, w in result.quantized.items() if n != left_out}
    out = write_checkpoint(model, quantized, "compressed-tensors", scheme, tmp_path / "ckpt", dtype=torch.bfloat16)
    sizes = header_bytes(out / "model.safetensors")
    assert len(quantized) == 6
    for linear, w in quantized.items():
        n, k = w.shape
        written = sum(b for t, b in sizes.items() if t.startswith(f"{linear}."))
        assert stored_bytes(cand.scheme, n, k, "bfloat16") == written, linear
    n, k = model.get_submodule(left_out).weight.shape
    assert stored_bytes(None, n, k, "bfloat16") == sizes[f"{left_out}.weight"]


def test_bits_per_weight_of_common_schemes() -> None:
    # hand arithmetic for a 4096 x 4096 bfloat16 linear: codes + 16-bit scale per group (+ shape)
    assert bits_per_weight(parse_candidate("W4A16").scheme, 4096, 4096, "bfloat16") == pytest.approx(
        4 + 16 / 128 + 128 / 4096**2
    )
    assert bits_per_weight(parse_candidate("NVFP4A16").scheme, 4096, 4096, "bfloat16") == pytest.approx(
        4 + 8 / 16 + 32 / 4096**2
    )
    assert bits_per_weight(None, 10, 10, "float32") == 32


def test_candidate_names() -> None:
    names = [c.name for c in parse_candidates("w4a16, W4A16_G32,FP8,none")]
    assert names == ["W4A16", "W4A16_G32", "FP8", "NONE"]
    assert parse_candidate("W4A16_G32").scheme.group_size == 32
    assert parse_candidate("FP8").scheme.granularity == "channel"  # FP8_DYNAMIC's weights
    full = parse_candidate("w4a16_g64_full").scheme
    assert (full.group_size, full.symmetric, full.full_range) == (64, True, True)
    assert parse_candidate("W4A16_G64").scheme.full_range is False
    for bad, says in [
        ("W8A8", "quantizes activations"),
        ("NVFP4", "quantizes activations"),
        ("W4A61", "--candidates 'W4A61' is not a preset"),
        ("FP8_G32", "no group size"),
        ("W4A16_ASYM_FULL", "full-range grid of symmetric INT groups"),
        ("FP8_FULL", "full-range grid of symmetric INT groups"),
    ]:
        with pytest.raises(BadInput, match=says):
            parse_candidate(bad)
    with pytest.raises(BadInput, match="twice"):
        parse_candidates("W4A16,w4a16")
