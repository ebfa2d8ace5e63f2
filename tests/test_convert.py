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


def assert_lossless(src: Path, out: Path, method: str = "compressed-tensors") -> int:
    _, a, rest_a = read_checkpoint(src)
    cfg, b, rest_b = read_checkpoint(out)
    assert cfg["quantization_config"]["quant_method"] == method
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


def _gptq_source(tmp_path: Path, tiny: Path, *, sym: bool, g_idx_perm: bool, bits: int = 4) -> Path:
    """A GPTQ v1 checkpoint of the tiny model's linears from the format's definition."""
    from infer_tool.packers.checkpoint import load_tensors
    from infer_tool.packers.packing import pack_int32

    src = tmp_path / "gptq"
    src.mkdir()
    tensors = load_tensors(tiny)
    gen = torch.Generator().manual_seed(3)
    g = 32
    out = {}
    for key, t in tensors.items():
        if not key.endswith("proj.weight"):
            out[key] = t
            continue
        name = key.removesuffix(".weight")
        n, k = t.shape
        G = k // g
        top = 1 << bits
        q = torch.randint(0, top, (n, k), generator=gen, dtype=torch.uint8)
        zero = torch.full((G, n), top // 2) if sym else torch.randint(1, top, (G, n), generator=gen)
        g_idx = torch.arange(k) // g
        if g_idx_perm:
            g_idx = g_idx[torch.randperm(k, generator=gen)]
        out[f"{name}.qweight"] = pack_int32(q.T.contiguous(), bits, dim=0)  # (K·b/32, N), along K
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


# ---------------------------------------------------------------- back: compressed-tensors -> AWQ, GPTQ, native FP8

BACK = {  # source checkpoint -> the --to that writes its format again
    "awq": "awq",
    "gptq-sym": "gptq",
    "gptq-sym8": "gptq",
    "gptq-asym": "gptq",
    "gptq-asym8": "gptq",
    "fp8-block": "fp8",
    "fp8-tensor": "fp8",
    "fp8-tensor-static": "fp8",
}


def _source(name: str, tiny: Path, tmp_path: Path) -> Path:
    """A checkpoint in the format `name`: our writers (AWQ, GPTQ sym, native FP8) or GPTQ v1's
    definition (asymmetric, which our writer does not emit)."""
    if name.startswith("gptq-asym"):
        return _gptq_source(tmp_path, tiny, sym=False, g_idx_perm=False, bits=8 if name.endswith("8") else 4)
    flags = {
        "gptq-sym8": ("--method", "rtn", "--bits", "8", "--sym", "--group-size", "32", "--format", "gptq"),
        "fp8-tensor-static": (*SOURCES["fp8-tensor"], "--fp8-activations", "static"),
    }.get(name) or SOURCES[name]
    calib = ("--calib", _corpus(tmp_path), "--num-samples", "2", "--seq-len", "32") if "static" in name else ()
    fast = () if calib else ("--no-layer-error",)
    r = invoke("quantize", tiny, "--out", tmp_path / "src", *fast, "--no-progress", *flags, *calib)
    assert r.exit_code == 0, r.output
    return tmp_path / "src"


def _corpus(tmp_path: Path) -> Path:
    from tiny import TEXT

    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def _ppl(ckpt: Path, corpus: Path, *flags: str) -> float:
    r = invoke("eval", "ppl", ckpt, "--data", corpus, "--seq-len", "64", "--json", "--no-progress", *flags)
    assert r.exit_code == 0, r.output
    return float(json.loads(r.stdout)["ppl"])


@pytest.mark.parametrize("name", sorted(BACK))
def test_convert_back_round_trip_is_byte_for_byte(name: str, tiny: Path, tmp_path: Path) -> None:
    """Format X -> compressed-tensors -> X: every tensor of the round trip equals the source's bit
    for bit (codes, zero points, float16 / float32 scales, g_idx, input scales), the compressed-
    tensors step dequantizes to the source's weights bit for bit, and `eval ppl` reads the
    converted-back checkpoint to the compressed-tensors one's perplexity (weights only for FP8:
    compressed-tensors' dynamic activations are per token, native FP8's per tensor)."""
    from safetensors.torch import load_file

    src = _source(name, tiny, tmp_path)
    to = BACK[name]
    r = invoke("convert", src, "--out", tmp_path / "ct", "--no-progress")
    assert r.exit_code == 0, r.output
    assert assert_lossless(src, tmp_path / "ct") == 14
    r = invoke("convert", tmp_path / "ct", "--to", to, "--out", tmp_path / "back", "--no-progress", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["linears"] == 14 and report["source_format"] == "compressed-tensors"
    assert report["format"].startswith({"awq": "AutoAWQ GEMM", "gptq": "GPTQ v1", "fp8": "native fp8"}[to])
    assert assert_lossless(src, tmp_path / "back", method=to) == 14
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k
    qa = json.loads((src / "config.json").read_text())["quantization_config"]
    qb = json.loads((tmp_path / "back" / "config.json").read_text())["quantization_config"]
    keys = {
        "awq": ("quant_method", "bits", "group_size", "zero_point", "version"),
        "gptq": ("quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format"),
        "fp8": ("quant_method", "activation_scheme", "weight_block_size"),
    }[to]
    assert {k: qa.get(k) for k in keys} == {k: qb.get(k) for k in keys}
    if name == "gptq-asym8":
        return  # eval ppl refuses 8-bit asymmetric weights (its kernels take 4-bit and 8-bit symmetric)
    corpus = _corpus(tmp_path)
    flags = ("--activations", "none") if to == "fp8" else ()
    ct, back = _ppl(tmp_path / "ct", corpus, *flags), _ppl(tmp_path / "back", corpus, *flags)
    assert abs(back / ct - 1) < 1e-5, (back, ct)


@pytest.mark.parametrize(
    "flags, to",
    [
        (("--method", "rtn", "--asym", "--group-size", "32", "--dtype", "bfloat16"), "awq"),
        (("--method", "rtn", "--sym", "--group-size", "32", "--dtype", "bfloat16"), "gptq"),
        (("--method", "rtn", "--bits", "8", "--asym", "--group-size", "32", "--dtype", "float16"), "gptq"),
        (("--method", "rtn", "--sym", "--group-size", "-1", "--dtype", "bfloat16"), "gptq"),
        (("--method", "fp8", "--fp8-granularity", "block"), "fp8"),
    ],
)
def test_compressed_tensors_converts_back_losslessly(flags: tuple, to: str, tiny: Path, tmp_path: Path) -> None:
    """Our compressed-tensors checkpoints (bfloat16 / float16 INT scales, which float16 holds;
    float32 FP8 scales) into AWQ, GPTQ v1 and native FP8: dequantized weights bit for bit, and back
    to compressed-tensors bit for bit again."""
    r = invoke("quantize", tiny, "--out", tmp_path / "ct", "--no-layer-error", "--no-progress", *flags)
    assert r.exit_code == 0, r.output
    r = invoke("convert", tmp_path / "ct", "--to", to, "--out", tmp_path / "x", "--no-progress")
    assert r.exit_code == 0, r.output
    assert assert_lossless(tmp_path / "ct", tmp_path / "x", method=to) == 14
    r = invoke("convert", tmp_path / "x", "--out", tmp_path / "ct2", "--no-progress")
    assert r.exit_code == 0, r.output
    assert assert_lossless(tmp_path / "ct", tmp_path / "ct2") == 14


def test_convert_back_refusals_name_why(tiny: Path, tmp_path: Path) -> None:
    """What the target cannot carry: exit 2 naming why, nothing written."""
    cases = [
        (("--method", "rtn", "--fp4", "nvfp4"), "gptq", "E2M1"),
        (("--method", "fp8", "--fp8-granularity", "channel"), "fp8", "per output channel"),
        (("--method", "rtn", "--bits", "8", "--sym", "--group-size", "32", "--dtype", "bfloat16"), "awq", "4-bit"),
        (("--method", "rtn", "--sym", "--group-size", "32", "--dtype", "float32"), "awq", "not a float16 value"),
        (("--method", "rtn", "--sym", "--group-size", "-1", "--dtype", "bfloat16"), "awq", "per output channel"),
        (("--method", "rtn", "--sym", "--group-size", "32", "--dtype", "bfloat16"), "fp8", "e4m3 weights"),
        (("--scheme", "W8A8", "--method", "rtn"), "gptq", "weight-only"),
    ]
    for i, (flags, to, words) in enumerate(cases):
        src = tmp_path / f"src{i}"
        r = invoke("quantize", tiny, "--out", src, "--no-layer-error", "--no-progress", *flags)
        assert r.exit_code == 0, r.output
        r = invoke("convert", src, "--to", to, "--out", tmp_path / "o", "--no-progress")
        assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output, (flags, to, r.output)
    r = invoke(
        "convert",
        _gptq_source(tmp_path, tiny, sym=True, g_idx_perm=False),
        "--to",
        "awq",
        "--out",
        tmp_path / "o",
        "--no-progress",
    )
    assert r.exit_code == 2 and "--to compressed-tensors first" in r.output, r.output
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.tmp-*"))


def test_gptq_back_refuses_a_zero_point_of_zero(tiny: Path, tmp_path: Path) -> None:
    """GPTQ v1 stores zero - 1: an asymmetric compressed-tensors linear with a zero point of 0 is
    refused naming the linear (AutoAWQ, which stores zeros as they are, carries it)."""
    from safetensors.torch import load_file

    r = invoke(
        "quantize",
        tiny,
        "--out",
        tmp_path / "ct",
        "--no-layer-error",
        "--no-progress",
        "--method",
        "rtn",
        "--asym",
        "--group-size",
        "32",
        "--dtype",
        "bfloat16",
    )
    assert r.exit_code == 0, r.output
    state = load_file(str(tmp_path / "ct" / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight_zero_point"
    state[key] = torch.zeros_like(state[key])
    save_file(state, str(tmp_path / "ct" / "model.safetensors"), metadata={"format": "pt"})
    r = invoke("convert", tmp_path / "ct", "--to", "gptq", "--out", tmp_path / "o", "--no-progress")
    assert r.exit_code == 2 and "model.layers.0.mlp.down_proj" in r.output and "zero point of 0" in r.output, r.output
    assert not (tmp_path / "o").exists()
    r = invoke("convert", tmp_path / "ct", "--to", "awq", "--out", tmp_path / "a", "--no-progress")
    assert r.exit_code == 0, r.output
    assert assert_lossless(tmp_path / "ct", tmp_path / "a", method="awq") == 14


# ---------------------------------------------------------------- ModelOpt NVFP4 (tests/producers.py)


def _modelopt(tmp_path: Path, *, w4a4: bool, legacy: bool, exact_scale: bool = False) -> tuple[Path, Path]:
    """A ModelOpt NVFP4 checkpoint of a tiny Llama from ModelOpt's layout; `exact_scale` sets every
    linear's amax so that weight_scale_2 = 2^-10 (a power of two: float32 carries its reciprocal)."""
    from producers import write_producer

    model = save_tiny_llama(tmp_path / "model", tie=True)
    if exact_scale:
        from safetensors.torch import load_file

        state = load_file(str(model / "model.safetensors"))
        for k, v in state.items():
            if k.endswith("proj.weight"):
                state[k] = (v / v.abs().max() * (2688 * 2.0**-10)).contiguous()
        save_file(state, str(model / "model.safetensors"), metadata={"format": "pt"})
    return write_producer(model, tmp_path, "modelopt-nvfp4" if w4a4 else "modelopt-w4a16", legacy_modelopt=legacy)


@pytest.mark.parametrize("w4a4,legacy", [(True, False), (False, True)])
def test_modelopt_nvfp4_converts_with_its_codes_and_scales(w4a4: bool, legacy: bool, tmp_path: Path) -> None:
    """Codes and E4M3 block scales byte for byte; the global scale g is the reciprocal of ModelOpt's
    multiplier weight_scale_2 (ws2): vLLM's dequantization of the converted checkpoint,
    value · (s · float32(1 / g)), equals ModelOpt's value · (s · ws2) bit for bit wherever
    float32(1 / g) == ws2, and the report counts it; compressed-tensors' effective scale s / g is
    within 2^-22 (relative) of ModelOpt's s · ws2 everywhere (float32 rounding)."""
    from safetensors.torch import load_file

    src, _ = _modelopt(tmp_path, w4a4=w4a4, legacy=legacy)
    r = invoke("convert", src, "--out", tmp_path / "ct", "--no-progress", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["linears"] == 14 and report["source_format"] == "modelopt"
    assert not (tmp_path / "ct" / "hf_quant_config.json").exists()
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized"
    assert (qc["config_groups"]["group_0"]["input_activations"] is not None) is w4a4
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "ct" / "model.safetensors"))
    values = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    recip_exact = 0
    for key in sorted(k for k in a if k.endswith(".weight_scale_2")):
        name = key.removesuffix(".weight_scale_2")
        assert torch.equal(a[f"{name}.weight"], b[f"{name}.weight_packed"]), name
        assert torch.equal(a[f"{name}.weight_scale"].view(torch.uint8), b[f"{name}.weight_scale"].view(torch.uint8))
        ws2, g = a[key].float(), b[f"{name}.weight_global_scale"].float()
        assert g.shape == (1,) and abs(float(g * ws2) - 1) < 2e-7
        if w4a4:
            assert abs(float(b[f"{name}.input_global_scale"] * a[f"{name}.input_scale"]) - 1) < 2e-7
        packed = a[f"{name}.weight"]
        codes = torch.stack((packed & 15, packed >> 4), -1).flatten(-2).long()
        v = values[codes].unflatten(-1, (-1, 16))
        s = a[f"{name}.weight_scale"].float().unsqueeze(-1)
        modelopt = v * (s * ws2)
        if torch.equal(1.0 / g, ws2.reshape(1)):
            recip_exact += 1
            assert torch.equal(v * (s * (1.0 / g)), modelopt), name
        assert bool(((s / g - s * ws2).abs() <= s * ws2 * 2.0**-22).all()), name
        ct = v * (s / g)
        assert bool(((ct - modelopt).abs() <= modelopt.abs() * 2.0**-21).all()), name
    assert f"in {recip_exact} of 14" in report["notes"][0], report["notes"]


def test_modelopt_nvfp4_power_of_two_scale_converts_bit_for_bit(tmp_path: Path) -> None:
    """weight_scale_2 = 2^-10: g = 1024 carries it exactly, so the converted checkpoint dequantizes
    (our compressed-tensors reader, s / g) to ModelOpt's weights bit for bit, in every linear."""
    from safetensors.torch import load_file

    src, ref = _modelopt(tmp_path, w4a4=False, legacy=False, exact_scale=True)
    r = invoke("convert", src, "--out", tmp_path / "ct", "--no-progress", "--json")
    assert r.exit_code == 0, r.output
    note = json.loads(r.stdout)["notes"][0]
    assert "exactly (vLLM dequantizes the same weights) in 14 of 14" in note and "bit for bit) in 14 of 14" in note
    _, layers, _ = read_checkpoint(tmp_path / "ct")
    want = load_file(str(ref / "model.safetensors"))
    assert len(layers) == 14
    for name, w in layers.items():
        assert float(w.global_scale) == 1024.0
        assert torch.equal(w.dequantize(torch.float32).view(torch.int32), want[f"{name}.weight"].view(torch.int32)), (
            name
        )


def test_converted_modelopt_loads_in_transformers(tmp_path: Path) -> None:
    """transformers + compressed-tensors (an independent reader) load the converted W4A16 checkpoint:
    logits in bfloat16 (its FP4 decompression's dtype) within 1e-3 of the largest logit of the
    float model holding ModelOpt's dequantized weights."""
    from transformers import AutoModelForCausalLM

    src, ref = _modelopt(tmp_path, w4a4=False, legacy=True)
    assert invoke("convert", src, "--out", tmp_path / "ct", "--no-progress").exit_code == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.bfloat16)
    want = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.bfloat16)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = hf(input_ids=ids).logits.float(), want(input_ids=ids).logits.float()
    assert float((a - b).abs().max()) <= 1e-3 * float(b.abs().max()) + 1e-6


@pytest.mark.parametrize("legacy", [False, True])
def test_modelopt_fp8_converts_as_a_copy(legacy: bool, tmp_path: Path) -> None:
    """ModelOpt FP8 (tests/producers.py, from its published layout): e4m3 weights byte for byte, the
    per-tensor weight_scale and static input_scale multipliers as compressed-tensors' (1,) scales;
    the converted checkpoint dequantizes to ModelOpt's weights bit for bit, and `eval ppl` reads the
    source and the conversion to the same perplexity (served: static FP8 activations)."""
    from producers import write_producer
    from safetensors.torch import load_file

    model = save_tiny_llama(tmp_path / "model", tie=True)
    src, ref = write_producer(model, tmp_path, "modelopt-fp8", legacy_modelopt=legacy)
    r = invoke("convert", src, "--out", tmp_path / "ct", "--no-progress", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["linears"] == 14
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert qc["format"] == "float-quantized" and group["weights"]["strategy"] == "tensor"
    assert group["input_activations"]["dynamic"] is False
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "ct" / "model.safetensors"))
    want = load_file(str(ref / "model.safetensors"))
    _, layers, _ = read_checkpoint(tmp_path / "ct")
    assert len(layers) == 14
    for name, w in layers.items():
        assert torch.equal(a[f"{name}.weight"].view(torch.uint8), b[f"{name}.weight"].view(torch.uint8)), name
        for s in ("weight_scale", "input_scale"):
            assert b[f"{name}.{s}"].shape == (1,) and torch.equal(b[f"{name}.{s}"], a[f"{name}.{s}"].reshape(1)), name
        assert torch.equal(w.dequantize(torch.float32).view(torch.int32), want[f"{name}.weight"].view(torch.int32))
    corpus = _corpus(tmp_path)
    assert _ppl(src, corpus) == pytest.approx(_ppl(tmp_path / "ct", corpus), rel=1e-6)


def test_modelopt_refusals_name_why(tmp_path: Path) -> None:
    """Another quant_algo, another group size and a zero weight_scale_2: exit 2 naming the value, nothing written."""
    from safetensors.torch import load_file

    src, _ = _modelopt(tmp_path, w4a4=False, legacy=False)
    config = json.loads((src / "config.json").read_text())
    for change, words in (
        ({"quant_algo": "FP8_PB_WO"}, "'FP8_PB_WO'"),
        ({"group_size": 32}, "group_size 32"),
    ):
        bad = json.loads(json.dumps(config))
        bad["quantization_config"]["quantization"].update(change)
        (src / "config.json").write_text(json.dumps(bad))
        r = invoke("convert", src, "--out", tmp_path / "o", "--no-progress")
        assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output, r.output
    (src / "config.json").write_text(json.dumps(config))
    state = load_file(str(src / "model.safetensors"))
    key = next(k for k in state if k.endswith(".weight_scale_2"))
    state[key] = torch.tensor(0.0)
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    r = invoke("convert", src, "--out", tmp_path / "o", "--no-progress")
    assert r.exit_code == 2 and key in r.output and "positive finite" in r.output, r.output
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.tmp-*"))
