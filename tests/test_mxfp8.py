"""MXFP8 (`formats/mxfp8/`): the numerics against compressed-tensors (the library that writes
and reads `mxfp8-quantized`) and float64 written-out rules, GPTQ on its grid, the checkpoint
read back by our loader and by transformers + compressed-tensors, `eval ppl` equal to
`--eval`, and the refusals a user meets. Equality is exact where the reference computes the
same float32 operations; tolerances are stated where it does not."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import MXFP8QuantizationCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tiny import TEXT, save_tiny_llama  # noqa: E402

from infer_tool.calib.stats import LayerStats  # noqa: E402
from infer_tool.cli.app import app  # noqa: E402
from infer_tool.formats.mxfp8 import numerics  # noqa: E402
from infer_tool.formats.mxfp8.scheme import Mxfp8AutoRoundScheme, Mxfp8GPTQScheme, Mxfp8Scheme  # noqa: E402
from infer_tool.formats.mxfp8.solve import quantize_gptq, quantize_rtn  # noqa: E402
from infer_tool.schemes.registry import make_scheme  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
runner = CliRunner()


def weights(dtype: torch.dtype, N: int = 12, K: int = 128, seed: int = 3) -> torch.Tensor:
    """Groups spread over 16 binades, some maxima just below / at a power of two's 1.75."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 2.0 ** torch.randint(-8, 8, (N, K // 32, 1), generator=g).repeat_interleave(
        32, 1
    ).reshape(N, K)
    w[0, 0] = 1.75 * 2.0**3
    w[1, 32] = 1.7499 * 2.0**-2
    return w.to(dtype)


def mx8_exponent(amax: float) -> int:
    """compressed-tensors' E8M0 exponent of a group max for 8-bit elements, in float64: the max
    rounded up to the next power of two from 1.75 of its binade, its log2, + 127 - 8."""
    if amax == 0.0:
        return 0
    e = math.floor(math.log2(amax))
    if amax / 2.0**e >= 1.75:
        e += 1
    return min(max(127 + e - 8, 0), 254)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_weight_bytes_and_dequant_match_the_compressor(dtype):
    w = weights(dtype)
    ours = quantize_rtn(w)
    assert ours.values.dtype == torch.float8_e4m3fn and ours.scale_exp.dtype == torch.uint8
    assert ours.scale_exp.shape == (12, 4)
    sch = preset_name_to_scheme("MXFP8A16", ["Linear"])
    grouped = w.unflatten(-1, (-1, 32))
    s_ref, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), sch.weights)
    assert torch.equal(numerics.scale_value(ours.scale_exp), s_ref.float())
    comp = MXFP8QuantizationCompressor.compress({"weight": w, "weight_scale": s_ref}, sch)
    assert torch.equal(comp["weight"].view(torch.uint8), ours.values.view(torch.uint8))
    assert torch.equal(comp["weight_scale"], ours.scale_exp)
    dec = MXFP8QuantizationCompressor.decompress(comp, sch)["weight"]
    assert torch.equal(ours.dequantize(dec.dtype), dec)


def test_exponent_rule_against_float64():
    amax = [0.0, 1.0, 1.5, 1.7499999, 1.75, 1.9999999, 448.0, 480.0, 2.0**-126, 3.0e-39, 1.0e30, 2.0**-118 * 1.8]
    g = torch.Generator().manual_seed(5)
    amax += (
        torch.rand(500, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-8, 8, (500,), generator=g)
    ).tolist()
    a = torch.tensor(amax, dtype=torch.float32)
    ref = torch.tensor([mx8_exponent(float(v)) for v in a.double()], dtype=torch.uint8)
    assert torch.equal(numerics.weight_scales(a), ref)
    assert numerics.weight_scales(torch.tensor([448.0])).item() == 128  # 448 = 1.75 * 256 rounds up to 512 = 2^9
    assert numerics.weight_scales(torch.tensor([256.0])).item() == 127


def test_saturation_and_round_trip_bound():
    """A group whose max rounds up past 448 saturates to ±448 (as compressed-tensors' clamp);
    every other value is within half an E4M3 step (2^-4 relative) of w."""
    w = weights(torch.float32, N=32, K=256, seed=9)
    q = quantize_rtn(w)
    deq = q.dequantize()
    scale = numerics.scale_value(q.scale_exp).repeat_interleave(32, 1)
    assert float((deq.abs() / scale).max()) <= 448.0
    ok = (w.abs() / scale) <= 448.0
    rel = ((deq - w).abs() / w.abs().clamp_min(1e-30))[ok & (w.abs() / scale >= 2.0**-6)]
    assert float(rel.max()) <= 2.0**-4


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_activations_match_vllms_rule_in_float64(dtype):
    """vLLM 0.32's dynamic MXFP8 input quantizer (`mxfp8_utils._mxfp8_e4m3_quantize_torch`):
    u = ceil(log2(max|x| / 448)) + 127 per 32, nothing saturates; written out in float64."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(5, 96, generator=g) * 10.0 ** torch.randint(-3, 4, (5, 96), generator=g)).to(dtype)
    x[0, :32] = 0.0
    got = numerics.qdq_activations(x)
    assert got.dtype == dtype
    xg = x.double().unflatten(-1, (-1, 32))
    amax = xg.abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny)
    u = (torch.ceil(torch.log2(amax / 448.0)) + 127).clamp(0, 254)
    scale = torch.exp2(u - 127)[..., None]
    ref = ((xg / scale).float().to(torch.float8_e4m3fn).double() * scale).flatten(-2).to(dtype)
    assert torch.equal(got, ref)
    assert (got[0, :32] == 0).all()


def test_activations_differ_from_compressed_tensors_rule_only_at_a_binade_boundary():
    """compressed-tensors' dynamic MX rule (its weights' rule) and vLLM's pick the same scale but
    where a group's max is exactly 1.75 * 2^k (= 448 * 2^(k-8)): there compressed-tensors doubles
    it and vLLM, which needs no headroom, keeps it; random groups agree to the bit."""
    args = preset_name_to_scheme("MXFP8", ["Linear"]).input_activations

    def ct(x: torch.Tensor) -> torch.Tensor:
        s, z = compute_dynamic_scales_and_zp(x, args, None)
        return ct_fake_quantize(x, s, z, args)

    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 96, generator=g) * 10.0 ** torch.randint(-3, 4, (64, 96), generator=g)
    assert torch.equal(ct(x), numerics.qdq_activations(x))
    edge = torch.tensor([[224.0] + [0.30078125] * 31])  # 224 = 1.75 * 2^7; 0.30078125 is on both grids
    ours, theirs = numerics.qdq_activations(edge), ct(edge)
    assert float(ours[0, 0]) == 224.0 and float(theirs[0, 0]) == 224.0
    x2 = torch.tensor([[224.0] + [0.003] * 31])  # subnormal in E4M3 at scale 1: the scales show
    assert not torch.equal(numerics.qdq_activations(x2), ct(x2))  # scale 0.5 against compressed-tensors' 1


def hessian(K: int, seed: int) -> LayerStats:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(512, K, generator=g) @ torch.randn(K, K, generator=g) * 0.3
    return LayerStats(H=2 * X.T @ X / 512, act_abs_mean=X.abs().mean(0), act_abs_max=float(X.abs().max()), tokens=512)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_on_the_mxfp8_grid(act_order):
    """GPTQ keeps RTN's scales (static groups), lands on the grid, and lowers the output error
    wᵀHw against RTN; a stacked solve gives each part its own solve's bits."""
    W = weights(torch.float32, N=24, K=128, seed=4)
    st = hessian(128, 1)
    scheme = Mxfp8GPTQScheme(act_order=act_order)
    rtn, gptq = quantize_rtn(W), quantize_gptq(W, st, scheme)
    assert torch.equal(gptq.scale_exp, rtn.scale_exp) and gptq.info["fallback"] is None
    deq = gptq.dequantize()
    assert torch.equal(numerics.quantize(deq, gptq.scale_exp).view(torch.uint8), gptq.values.view(torch.uint8))

    def err(Q: torch.Tensor) -> float:
        D = Q - W
        return float(torch.einsum("nk,kl,nl->", D, st.H, D))

    assert err(deq) < 0.8 * err(rtn.dequantize())
    stacked = quantize_gptq(torch.cat([W[:10], W[10:]]), st, scheme, parts=[10, 14])
    for rows, alone in (
        (slice(0, 10), quantize_gptq(W[:10], st, scheme)),
        (slice(10, 24), quantize_gptq(W[10:], st, scheme)),
    ):
        assert torch.equal(stacked.rows(rows).values.view(torch.uint8), alone.values.view(torch.uint8))


def test_gptq_falls_back_to_rtn_on_a_non_finite_hessian():
    W = weights(torch.float32, N=8, K=64)
    H = torch.eye(64)
    H[3, 3] = float("nan")
    w = quantize_gptq(W, H)
    assert w.info["fallback"] == "rtn" and torch.equal(
        w.values.view(torch.uint8), quantize_rtn(W).values.view(torch.uint8)
    )


def test_presets_pick_the_format_for_rtn_and_gptq():
    assert make_scheme("rtn", mxfp8_activations="none") == Mxfp8Scheme()
    assert make_scheme("gptq", mxfp8_activations="mxfp8") == Mxfp8GPTQScheme(mxfp8_activations="mxfp8")
    assert Mxfp8GPTQScheme().describe() == "gptq mxfp8 (MXFP8A16) act-order"
    assert make_scheme("autoround", mxfp8_activations="none", iters=7) == Mxfp8AutoRoundScheme(iters=7)


def test_autoround_at_its_start_is_rtn_and_stores_what_it_evaluates():
    """At V = 0, β = 1 the learned rounding is MXFP8 RTN bit for bit; at any V, β the weight it
    stores dequantizes to exactly the Ŵ the descent evaluated (so the tuned loss is the stored
    model's)."""
    from infer_tool.formats.mxfp8.autoround import Mxfp8Grouped, fake_quantize_rounding, quantize_rounding
    from infer_tool.packers.autoround import Rounding

    g = torch.Generator().manual_seed(3)
    W = torch.randn(48, 96, generator=g) * torch.logspace(-3, 1, 96)  # groups across binades
    W[5, :32] = 0.0  # an all-zero group
    grouped, scheme = Mxfp8Grouped.of(W), Mxfp8AutoRoundScheme()
    p = Rounding.initial(grouped.shape, 32)
    start, rtn = quantize_rounding(grouped, p, scheme), quantize_rtn(W)
    assert torch.equal(start.values.view(torch.uint8), rtn.values.view(torch.uint8))
    assert torch.equal(start.scale_exp, rtn.scale_exp)
    with torch.no_grad():
        p.V.copy_(torch.rand(p.V.shape, generator=g) - 0.5)
        p.beta.copy_(0.5 + 0.5 * torch.rand(p.beta.shape, generator=g))
    tuned = quantize_rounding(grouped, p, scheme)
    assert torch.equal(fake_quantize_rounding(grouped, p, scheme).detach(), tuned.dequantize())
    assert not torch.equal(tuned.values.view(torch.uint8), rtn.values.view(torch.uint8))
    # the clip lowers a group's exponent by at most one binade for each halving of β
    assert int((rtn.scale_exp.int() - tuned.scale_exp.int()).min()) >= 0
    assert int((rtn.scale_exp.int() - tuned.scale_exp.int()).max()) <= 1


def invoke(*args: object) -> tuple[int, str]:
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout if r.exit_code == 0 else r.output


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:  # noqa: ANN001
    root = tmp_path_factory.mktemp("mxfp8")
    (root / "corpus.txt").write_text(TEXT * 4)
    save_tiny_llama(root / "model", tie=False)
    out = {"root": root}
    for name, flags in {
        "rtn-a16": ("--scheme", "MXFP8A16"),
        "gptq-w8a8": ("--scheme", "MXFP8", "--method", "gptq"),
        "autoround-a16": ("--scheme", "MXFP8A16", "--method", "autoround", "--iters", "4", "--batch", "4"),
    }.items():
        code, text = invoke(
            "quantize", root / "model", *flags, "--calib", root / "corpus.txt", "--out", root / name,
            "--eval", root / "corpus.txt", "--eval-tokens", "256", "--eval-seq-len", "64",
            "--num-samples", "8", "--seq-len", "32", "--no-progress", "--device", "cpu", "--json",
        )  # fmt: skip
        assert code == 0, text
        out[name] = json.loads(text)
    return out


def test_checkpoint_is_compressed_tensors_mxfp8(runs: dict) -> None:
    from infer_tool.formats.mxfp8.weight import Mxfp8Weight
    from infer_tool.packers.checkpoint import read_checkpoint

    for name, w8a8 in (("rtn-a16", False), ("gptq-w8a8", True), ("autoround-a16", False)):
        config, layers, _ = read_checkpoint(runs["root"] / name)
        qc = config["quantization_config"]
        assert qc["format"] == "mxfp8-quantized" and qc["config_groups"]["group_0"]["format"] == "mxfp8-quantized"
        assert (qc["config_groups"]["group_0"]["input_activations"] is not None) == w8a8
        assert layers and all(isinstance(w, Mxfp8Weight) for w in layers.values())
        assert {w.activations for w in layers.values()} == {"mxfp8" if w8a8 else "none"}
        report = runs[name]
        assert report["eval"]["activations"] == ("mxfp8 (e4m3, e8m0 per 32)" if w8a8 else "unquantized")


@pytest.mark.parametrize("name", ["rtn-a16", "gptq-w8a8", "autoround-a16"])
def test_eval_ppl_equals_quantize_eval(runs: dict, name: str) -> None:
    """`eval ppl` loads the checkpoint as `Mxfp8Linear`s (the FP8 GEMM with (1, 32) blocks) and
    gives `--eval`'s perplexity, activations included, to 1e-6 relative."""
    code, text = invoke(
        "eval", "ppl", runs["root"] / name, "--data", runs["root"] / "corpus.txt", "--max-tokens", "256",
        "--seq-len", "64", "--json", "--no-progress", "--device", "cpu",
    )  # fmt: skip
    assert code == 0, text
    doc = json.loads(text)
    assert doc["activations"] == runs[name]["eval"]["activations"]
    assert doc["backend"] != "torch-cpu (unquantized)"
    assert math.isclose(doc["ppl"], runs[name]["eval"]["ppl_after"], rel_tol=1e-6)


@pytest.mark.parametrize("name", ["rtn-a16", "gptq-w8a8", "autoround-a16"])
def test_transformers_with_compressed_tensors_reads_our_weights(runs: dict, name: str) -> None:
    """transformers + compressed-tensors loads the checkpoint as its MXFP8 linears (our values and
    E8M0 exponents, byte for byte) and dequantizes them itself; its logits equal a bfloat16 model
    holding our dequantized weights (with MXFP8 activations, its inputs through compressed-tensors'
    own dynamic MX rule) to 1e-3 of the largest logit."""
    from transformers import AutoModelForCausalLM

    from infer_tool.packers.checkpoint import read_checkpoint

    root = runs["root"]
    hf = AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.bfloat16)
    _, layers, rest = read_checkpoint(root / name)
    ref = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.bfloat16)
    args = preset_name_to_scheme("MXFP8", ["Linear"]).input_activations

    def ct_rule(mod, inputs):  # noqa: ANN001, ANN202
        s, z = compute_dynamic_scales_and_zp(inputs[0], args, None)
        return (ct_fake_quantize(inputs[0], s, z, args),)

    for n, w in layers.items():
        theirs = hf.get_submodule(n)  # compressed-tensors runs it compressed: our bytes, its dequantization
        assert torch.equal(theirs.weight.view(torch.uint8), w.values.view(torch.uint8))
        assert torch.equal(theirs.weight_scale, w.scale_exp)
        m = ref.get_submodule(n)
        m.weight.data = w.dequantize(torch.bfloat16)
        if w.activations == "mxfp8":
            m.register_forward_pre_hook(ct_rule)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = hf(ids).logits.float(), ref(ids).logits.float()
    assert float((a - b).abs().max()) <= 1e-3 * float(b.abs().max())


def test_refusals_name_the_value_and_what_is_accepted(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path / "model", tie=False)
    cases = {
        ("--mxfp8-activations", "fp8", "--method", "rtn"): "--mxfp8-activations 'fp8' is not supported; use none",
        ("--scheme", "MXFP8", "--method", "awq"): "--scheme MXFP8 sets --mxfp8-activations, which --method awq",
        ("--scheme", "MXFP8A16", "--bits", "4"): "they set two number formats of --method rtn (MXFP8 fixes",
        ("--scheme", "MXFP8A16", "--format", "awq"): "format 'awq' is not supported for mxfp8 weights",
    }
    for flags, message in cases.items():
        code, text = invoke("quantize", tmp_path / "model", "--out", tmp_path / "out", *flags)
        assert code == 2 and message in " ".join(text.split()), (flags, text)
        assert not (tmp_path / "out").exists()
