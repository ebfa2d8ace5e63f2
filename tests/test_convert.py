"""`infer-tool convert SRC --to compressed-tensors`: lossless, per source format.

Each source checkpoint is read by its format's reader and the converted one by the
compressed-tensors reader: the integer codes, scales and zero points (or e4m3 values and
scales), and so the dequantized weights, must be equal bit for bit; transformers +
compressed-tensors (an independent reader) must load a converted GPTQ checkpoint and give a
model holding those weights (GPTQ symmetric: transformers 5 + compressed-tensors load no
asymmetric pack-quantized checkpoint, tests/test_quantize_cli.py). The GPTQ asymmetric and
act-order sources are built here from GPTQ v1's published layout (qweight packed along K,
qzeros storing zero - 1, fp16 scales, g_idx), which our writer does not emit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tiny import save_tiny_llama  # noqa: E402

from infer_tool.cli.app import app  # noqa: E402
from infer_tool.packers.checkpoint import read_checkpoint  # noqa: E402

SOURCES = {
    "awq": ("--method", "rtn", "--asym", "--group-size", "32", "--format", "awq"),
    "gptq-sym": ("--method", "rtn", "--sym", "--group-size", "32", "--format", "gptq"),
    "fp8-block": ("--method", "fp8", "--fp8-granularity", "block", "--format", "fp8"),
    "fp8-tensor": ("--method", "fp8", "--fp8-granularity", "tensor", "--format", "fp8"),
}


def invoke(*args: object):  # noqa: ANN201
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", tie=False)


def assert_lossless(src: Path, out: Path) -> int:
    _, a, rest_a = read_checkpoint(src)
    cfg, b, rest_b = read_checkpoint(out)
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    assert sorted(a) == sorted(b) and a
    for name in a:
        wa, wb = a[name].dequantize(torch.float32), b[name].dequantize(torch.float32)
        assert torch.equal(wa.view(torch.int32), wb.view(torch.int32)), name
    assert sorted(rest_a) == sorted(rest_b)
    for k in rest_a:
        assert torch.equal(rest_a[k], rest_b[k]), k
    return len(a)


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_convert_is_lossless(name: str, tiny: Path, tmp_path: Path) -> None:
    r = invoke("quantize", tiny, "--out", tmp_path / "src", "--no-layer-error", "--no-progress", *SOURCES[name])
    assert r.exit_code == 0, r.output
    r = invoke("convert", tmp_path / "src", "--out", tmp_path / "ct", "--no-progress", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["linears"] == 14
    assert assert_lossless(tmp_path / "src", tmp_path / "ct") == 14
    assert (tmp_path / "ct" / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()


def test_converted_gptq_loads_in_transformers(tiny: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    r = invoke("quantize", tiny, "--out", tmp_path / "src", "--no-layer-error", "--no-progress", *SOURCES["gptq-sym"])
    assert r.exit_code == 0, r.output
    assert invoke("convert", tmp_path / "src", "--out", tmp_path / "ct", "--no-progress").exit_code == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32)
    _, layers, _ = read_checkpoint(tmp_path / "src")
    ref = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    for n, w in layers.items():
        ref.get_submodule(n).weight.data = w.dequantize(torch.float32)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = hf(ids).logits, ref(ids).logits
    assert float((a - b).norm() / b.norm()) < 1e-4


def _gptq_source(tmp_path: Path, tiny: Path, *, sym: bool, g_idx_perm: bool) -> Path:
    """A GPTQ v1 checkpoint of the tiny model's linears from the format's definition."""
    from infer_tool.packers.checkpoint import load_tensors
    from infer_tool.packers.packing import pack_int32

    src = tmp_path / "gptq"
    src.mkdir()
    tensors = load_tensors(tiny)
    gen = torch.Generator().manual_seed(3)
    bits, g = 4, 32
    out = {}
    for key, t in tensors.items():
        if not key.endswith("proj.weight"):
            out[key] = t
            continue
        name = key.removesuffix(".weight")
        n, k = t.shape
        G = k // g
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        zero = torch.full((G, n), 8) if sym else torch.randint(1, 16, (G, n), generator=gen)
        g_idx = torch.arange(k) // g
        if g_idx_perm:
            g_idx = g_idx[torch.randperm(k, generator=gen)]
        out[f"{name}.qweight"] = pack_int32(q.T.contiguous(), bits, dim=0)  # (K/8, N), along K
        out[f"{name}.qzeros"] = pack_int32((zero - 1).to(torch.uint8), bits, dim=1)  # (G, N/8)
        out[f"{name}.scales"] = (torch.rand(G, n, generator=gen) * 0.01 + 1e-3).to(torch.float16)
        out[f"{name}.g_idx"] = g_idx.to(torch.int32)
    save_file(out, str(src / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tiny / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": g,
        "sym": sym,
        "desc_act": g_idx_perm,
        "checkpoint_format": "gptq",
    }
    (src / "config.json").write_text(json.dumps(config))
    (src / "tokenizer.json").write_bytes((tiny / "tokenizer.json").read_bytes())
    return src


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_v1_from_its_definition_converts_losslessly(sym: bool, tiny: Path, tmp_path: Path) -> None:
    src = _gptq_source(tmp_path, tiny, sym=sym, g_idx_perm=False)
    r = invoke("convert", src, "--out", tmp_path / "ct", "--no-progress")
    assert r.exit_code == 0, r.output
    assert assert_lossless(src, tmp_path / "ct") == 14
    group = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert group["group_0"]["weights"]["symmetric"] is sym


def test_refusals_name_why_and_write_nothing(tiny: Path, tmp_path: Path) -> None:
    src = _gptq_source(tmp_path, tiny, sym=True, g_idx_perm=True)
    r = invoke("convert", src, "--out", tmp_path / "o", "--no-progress")
    assert r.exit_code == 2 and "g_idx" in r.output and "Traceback" not in r.output, r.output
    r = invoke("convert", tiny, "--out", tmp_path / "o", "--no-progress")
    assert r.exit_code == 2 and "not quantized" in r.output
    r = invoke("convert", src, "--out", tmp_path / "o", "--to", "gguf", "--no-progress")
    assert r.exit_code == 2 and "--to" in r.output
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.tmp-*"))


def test_overwrite_never_replaces_a_users_directory(tiny: Path, tmp_path: Path) -> None:
    """`convert --overwrite` follows quantize's ownership rule: a directory holding the user's file is
    refused (exit 2) with the file left as it was, and no temporary directory is left beside it."""
    src = _gptq_source(tmp_path, tiny, sym=True, g_idx_perm=False)
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "mine.txt").write_text("keep")
    r = invoke("convert", src, "--out", tmp_path / "o", "--overwrite", "--no-progress")
    assert r.exit_code == 2 and "mine.txt" in r.output, r.output
    assert (tmp_path / "o" / "mine.txt").read_text() == "keep" and sorted(
        p.name for p in (tmp_path / "o").iterdir()
    ) == ["mine.txt"]
    assert not list(tmp_path.glob(".o.tmp-*"))
