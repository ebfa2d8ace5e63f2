"""W4AFP8 (`formats/w4afp8/`): INT4 weights of every INT method with FP8 per-token activations.
The composition (an INT method's scheme and quantizer, pack-quantized tensors) is checked
against the INT path; the numerics vLLM's W4A8-FP8 kernel applies against float64 written-out
rules; the checkpoint read back by `eval ppl` (equal to `--eval`) and by transformers +
compressed-tensors; the refusals a user meets."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tiny import TEXT, save_tiny_llama  # noqa: E402

from infer_tool.cli.app import app  # noqa: E402
from infer_tool.formats.w4afp8 import numerics  # noqa: E402
from infer_tool.formats.w4afp8.scheme import W4Afp8AWQScheme, W4Afp8GPTQScheme  # noqa: E402
from infer_tool.packers.checkpoint import format_of, get_format  # noqa: E402
from infer_tool.schemes.integer import GPTQScheme  # noqa: E402
from infer_tool.schemes.registry import make_scheme  # noqa: E402

runner = CliRunner()
E4M3_MIN_NORMAL = 2.0**-6


def nearest_e4m3(v: float) -> float:
    """Round to nearest e4m3 (ties to even mantissa), saturating at 448, in float64 by definition."""
    if v == 0.0:
        return 0.0
    a, sign = abs(v), math.copysign(1.0, v)
    if a >= 448.0:
        return sign * 448.0
    e = max(math.floor(math.log2(a)), -6)  # subnormals share the step of 2^-6's binade
    step = 2.0 ** (e - 3)
    q = a / step
    r = math.floor(q)
    r = r + 1 if q - r > 0.5 or (q - r == 0.5 and r % 2 == 1) else r
    return sign * r * step


def test_group_scales_as_vllm_converts_them_in_float64():
    """c = max|s| / 448 per row (floored at 1/(448·512)), then e4m3(e4m3(s / c) / 8) · 8c."""
    g = torch.Generator().manual_seed(1)
    s = torch.rand(6, 9, generator=g) * 10.0 ** torch.randint(-4, 0, (6, 1), generator=g) + 1e-7
    s[0, 0] = s[0].max() * 1e-3  # deep in e4m3's subnormals after / 8
    got = numerics.hopper_group_scales(s)
    for n in range(6):
        c = max(float(s[n].max()) / 448.0, 1.0 / (448.0 * 512.0))
        c32 = float(torch.tensor(c, dtype=torch.float32))
        for j in range(9):
            f = nearest_e4m3(nearest_e4m3(float(s[n, j]) / c32) / 8.0)
            assert float(got[n, j]) == pytest.approx(f * 8.0 * c32, rel=1e-6, abs=0.0), (n, j)
    normal = (s / (s.amax(1, keepdim=True) / 448.0) / 8.0) >= E4M3_MIN_NORMAL
    assert float(((got - s).abs() / s)[normal].max()) <= 2.0**-4  # 3 mantissa bits


def test_activations_per_token_in_float64():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 40, generator=g) * 10.0 ** torch.randint(-2, 3, (4, 1), generator=g)
    x[3] = 0.0
    got = numerics.qdq_activations(x)
    for m in range(4):
        scale = max(float(x[m].abs().max()) / 448.0, 1.0 / (448.0 * 512.0))
        scale = float(torch.tensor(scale, dtype=torch.float32))
        for k in range(40):
            ref = nearest_e4m3(float(torch.tensor(float(x[m, k]), dtype=torch.float32) / scale)) * scale
            assert float(got[m, k]) == pytest.approx(ref, rel=1e-6, abs=1e-30)


def test_scheme_is_an_int_method_with_fp8_activations():
    s = make_scheme("gptq", bits=4, group_size=128, symmetric=True, activations="dynamic")
    assert type(s) is W4Afp8GPTQScheme and s.kind == "w4afp8"
    assert {k: v for k, v in s.to_dict().items() if k != "activations"} == GPTQScheme(group_size=128).to_dict()
    assert make_scheme("awq", symmetric=True, activations="dynamic") == W4Afp8AWQScheme(symmetric=True)


def test_pack_quantized_with_fp8_inputs_is_w4afp8_not_int():
    """llm-compressor's W4AFP8 config (its preset's args) is read by the W4AFP8 codec, and the INT
    codec no longer reads it as weights-only INT4."""
    args = preset_name_to_scheme("W4AFP8", ["Linear"])
    group = {
        "targets": ["Linear"],
        "weights": args.weights.model_dump(mode="json"),
        "input_activations": args.input_activations.model_dump(mode="json"),
    }
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": group}}
    assert format_of(qc).kind == "w4afp8"
    ours = get_format("compressed-tensors", "w4afp8").config(W4Afp8GPTQScheme(group_size=128), [])
    assert format_of(ours).kind == "w4afp8"
    ours["config_groups"]["group_0"]["input_activations"] = None
    assert format_of(ours).kind == "int"


def invoke(*args: object) -> tuple[int, str]:
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout if r.exit_code == 0 else r.output


METHODS = {"rtn": (), "gptq": (), "awq": (), "autoround": ("--iters", "3", "--lr", "0.05")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:  # noqa: ANN001
    root = tmp_path_factory.mktemp("w4afp8")
    (root / "corpus.txt").write_text(TEXT * 4)
    save_tiny_llama(root / "model", tie=False, hidden=128)  # K = 128 and 256: groups of 128
    out = {"root": root}
    for method, extra in METHODS.items():
        code, text = invoke(
            "quantize", root / "model", "--scheme", "W4AFP8", "--method", method, *extra,
            "--calib", root / "corpus.txt", "--out", root / method,
            "--eval", root / "corpus.txt", "--eval-tokens", "256", "--eval-seq-len", "64",
            "--num-samples", "8", "--seq-len", "32", "--no-progress", "--device", "cpu", "--json",
        )  # fmt: skip
        assert code == 0, text
        out[method] = json.loads(text)
    return out


@pytest.mark.parametrize("method", list(METHODS))
def test_every_int_method_writes_w4afp8_and_eval_ppl_equals_its_eval(runs: dict, method: str) -> None:
    report = runs[method]
    assert report["eval"]["activations"] == "fp8 (e4m3) per token, W4AFP8"
    qc = json.loads((runs["root"] / method / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert qc["format"] == "pack-quantized" and group["weights"]["num_bits"] == 4 and group["weights"]["symmetric"]
    assert (group["input_activations"]["type"], group["input_activations"]["strategy"]) == ("float", "token")
    code, text = invoke(
        "eval", "ppl", runs["root"] / method, "--data", runs["root"] / "corpus.txt", "--max-tokens", "256",
        "--seq-len", "64", "--json", "--no-progress", "--device", "cpu",
    )  # fmt: skip
    assert code == 0, text
    doc = json.loads(text)
    assert doc["activations"] == report["eval"]["activations"]
    assert math.isclose(doc["ppl"], report["eval"]["ppl_after"], rel_tol=1e-6)


def test_compressed_tensors_reads_our_config_and_decompresses_our_weights(runs: dict) -> None:
    """compressed-tensors parses our config into its own W4AFP8 preset (weights and activations),
    and its pack-quantized decompressor turns our tensors into our dequantized weights, bit for
    bit."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    from infer_tool.packers.checkpoint import read_checkpoint

    root = runs["root"]
    qc = json.loads((root / "gptq" / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    preset = preset_name_to_scheme("W4AFP8", ["Linear"])
    for ours, theirs in ((parsed.weights, preset.weights), (parsed.input_activations, preset.input_activations)):
        for field in ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic"):
            assert getattr(ours, field) == getattr(theirs, field), field
    _, layers, _ = read_checkpoint(root / "gptq")
    tensors = load_file(str(root / "gptq" / "model.safetensors"))
    for name, w in layers.items():
        state = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.rpartition(".")[0] == name}
        dec = PackedQuantizationCompressor.decompress(state, parsed)["weight"]
        assert torch.equal(dec.float(), w.dequantize(dec.dtype).float()), name


def test_transformers_with_compressed_tensors_gives_our_logits(runs: dict) -> None:
    """transformers + compressed-tensors loads the checkpoint (float32, its stored dtype) and
    quantizes its inputs to FP8 per token itself; its logits equal, to the bit, a model holding our
    dequantized INT4 weights whose inputs go through compressed-tensors' own activation rule (the
    stored group scales: compressed-tensors does not round them as vLLM's Hopper kernel does)."""
    from transformers import AutoModelForCausalLM

    from infer_tool.packers.checkpoint import read_checkpoint

    root = runs["root"]
    hf = AutoModelForCausalLM.from_pretrained(root / "gptq", dtype=torch.float32)
    _, layers, _ = read_checkpoint(root / "gptq")
    ref = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    args = preset_name_to_scheme("W4AFP8", ["Linear"]).input_activations

    def ct_rule(mod, inputs):  # noqa: ANN001, ANN202
        s, z = compute_dynamic_scales_and_zp(inputs[0], args, None)
        return (ct_fake_quantize(inputs[0], s, z, args),)

    for n, w in layers.items():
        m = ref.get_submodule(n)
        m.weight.data = w.dequantize(torch.float32)
        m.register_forward_pre_hook(ct_rule)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, ref(ids).logits)


def test_refusals_name_the_value_and_what_is_accepted(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path / "model", tie=False, hidden=128)
    cases = {
        ("--scheme", "W4AFP8", "--group-size", "64"): "W4AFP8 (FP8 activations on INT weights) needs 4-bit",
        ("--method", "gptq", "--group-size", "128", "--fp8-activations", "static"): "--fp8-activations static",
        ("--scheme", "W4AFP8", "--method", "gptq", "--asym"): "got bits=4 group_size=128 asym",
        ("--scheme", "W4AFP8", "--format", "awq"): "format 'awq' is not supported for w4afp8 weights",
    }
    for flags, message in cases.items():
        code, text = invoke("quantize", tmp_path / "model", "--out", tmp_path / "out", *flags)
        assert code == 2 and message in " ".join(text.split()), (flags, text)
        assert not (tmp_path / "out").exists()
