"""`--method autoround` (`packers/autoround.py`, `calib/quantizers/autoround.py`): the grid at
its starting point is RTN's, the straight-through gradients are the chain rule's, the descent
lowers every block's loss on a tiny trained Llama, the checkpoints of every INT4 format read
back (transformers + compressed-tensors where it loads the format, our reader everywhere) to
the pipeline's dequantized model, runs are deterministic under a seed, a killed run resumes
to the same bytes, and bad input exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_quantize_cli import one_thread, quantize, reference_model, run, tiny  # noqa: F401  (fixtures)
from test_resume import _digests, _run, work  # noqa: F401  (the kill driver and its fixture)

from infer_tool.packers.autoround import Grouped, Rounding, fake_quantize_rounding, quantize_rounding
from infer_tool.packers.rtn import quantize_rtn
from infer_tool.schemes.registry import make_scheme

FEW = ("--method", "autoround", "--group-size", "32", "--iters", "8", "--batch", "2")


def weight(n: int = 24, k: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # rows of different ranges


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
def test_the_starting_point_is_rtn_bit_for_bit(symmetric: bool, scale_dtype: str) -> None:
    scheme = make_scheme("autoround", group_size=16, symmetric=symmetric, scale_dtype=scale_dtype)
    W = weight()
    W[3, :16] = 0.0  # an all-zero group: scale 1, as RTN
    got = quantize_rounding(W, Rounding.initial(W.shape, 16), scheme)
    want = quantize_rtn(W, None, scheme)
    assert torch.equal(got.q, want.q) and torch.equal(got.scale, want.scale)
    assert (got.zero is None) == symmetric and (symmetric or torch.equal(got.zero, want.zero))
    assert torch.equal(
        fake_quantize_rounding(Grouped.of(W, scheme), Rounding.initial(W.shape, 16), scheme), want.dequantize()
    )


@pytest.mark.parametrize("symmetric", [True, False])
def test_straight_through_gradients_are_the_chain_rule(symmetric: bool) -> None:
    """With the rounding's derivative taken as 1: ∂Ŵ/∂V = s where the code is not clamped
    (0 where it is), and ∂Ŵ/∂β of a symmetric group whose max side sets the scale is
    Σ G·(q − z − W/s)·w_max/7 on the ±7 grid — checked against those formulas written out
    (the full-range grid's: tests/test_full_range.py)."""
    scheme = make_scheme("autoround", group_size=16, symmetric=symmetric, full_range=False)
    W = weight(8, 32, seed=1)
    p = Rounding.initial(W.shape, 16)
    with torch.no_grad():
        p.V.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(2))
        p.alpha.fill_(0.8)
        p.beta.fill_(0.7)
    G = torch.randn(W.shape, generator=torch.Generator().manual_seed(3))
    (fake_quantize_rounding(Grouped.of(W, scheme), p, scheme) * G).sum().backward()
    w = W.reshape(8, 2, 16)
    lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    if symmetric:
        s = torch.maximum(-lo * 0.8, hi * 0.7) / 7
        z = torch.full_like(s, 8.0)
    else:
        s = (hi * 0.7 - lo * 0.8) / 15
        z = torch.round(-lo * 0.8 / s)
    r = torch.round(w / s[..., None] + p.V.detach().reshape(8, 2, 16)) + z[..., None]
    inside = ((r >= 0) & (r <= 15)).float()
    assert torch.allclose(p.V.grad.reshape(8, 2, 16), G.reshape(8, 2, 16) * s[..., None] * inside, rtol=1e-6)
    if symmetric:
        q = r.clamp(0, 15)
        by_max = (hi * 0.7 > -lo * 0.8).float()
        dW_ds = (q - z[..., None]) - inside * w / s[..., None]
        want = (G.reshape(8, 2, 16) * dW_ds).sum(-1) * hi / 7 * by_max
        assert torch.allclose(p.beta.grad, want, rtol=1e-5, atol=1e-6)


def test_projection_keeps_the_ranges() -> None:
    p = Rounding.initial((2, 8), 4)
    with torch.no_grad():
        p.V.fill_(0.9)
        p.alpha.fill_(1.3)
        p.beta.fill_(-0.2)
    p.project()
    assert float(p.V.detach().max()) == 0.5 and float(p.alpha.detach().max()) == 1.0
    assert float(p.beta.detach().min()) == 0.0


@pytest.mark.parametrize("symmetric", [True, False])
def test_descent_lowers_every_block_loss_and_the_output_error(tiny: dict[str, Path], symmetric: bool) -> None:  # noqa: F811
    """Each block's best batch loss is well below step 0's (RTN), and the quantized model's
    logits on held-out text are closer to the fp model's than RTN's are. (The report's layer
    error compares with the fp layer on the quantized chain's inputs, which AutoRound does
    not aim at; its entries' `error_vs_fp_model` compares with the fp model's own outputs.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infer_tool.calib.corpora import calibration_batch, tokenize
    from infer_tool.calib.pipeline import quantize_model

    tok = AutoTokenizer.from_pretrained(tiny["model"])
    ids = calibration_batch(tok, str(tiny["calib"]), 8, 32, 0)
    held_out = tokenize(tiny["eval"].read_text(), tok, 256).reshape(4, 64)
    fp = AutoModelForCausalLM.from_pretrained(tiny["model"], dtype=torch.float32).eval()
    with torch.no_grad():
        want = fp(held_out).logits
    errors = {}
    for method, extra in (("autoround", {"iters": 30, "batch": 4}), ("rtn", {})):
        model = AutoModelForCausalLM.from_pretrained(tiny["model"], dtype=torch.float32).eval()
        result = quantize_model(
            model, ids, make_scheme(method, group_size=32, symmetric=symmetric, **extra), device="cpu"
        )
        with torch.no_grad():
            errors[method] = float((model(held_out).logits - want).norm() / want.norm())
        if method == "autoround":
            entries = result.method_report["autoround"]
            assert len(entries) == 2
            for e in entries:
                assert e["best_iter"] > 0 and e["best_loss"] < 0.9 * e["rtn_loss"], e
                assert 0 < e["error_vs_fp_model"] < 1, e
    assert errors["autoround"] < 0.9 * errors["rtn"], errors


def test_symmetric_checkpoint_loads_in_transformers_as_our_dequantized_model(
    tiny: dict[str, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ckpt"
    code, stdout, stderr = quantize(tiny, out, *FEW, "--sym", "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["method"] == "autoround" and report["scheme"]["iters"] == 8 and len(report["autoround"]) == 2
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours, quantized = reference_model(tiny, out)
    assert len(quantized) == 14 and all(qw.symmetric for qw in quantized.values())
    ids = torch.randint(3, 93, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = loaded(ids).logits, ours(ids).logits
    assert float((a - b).norm() / b.norm()) < 1e-4


@pytest.mark.parametrize(
    "fmt, sym", [("compressed-tensors", "--asym"), ("awq", "--asym"), ("awq", "--sym"), ("gptq", "--sym")]
)
def test_every_format_reads_back_to_the_pipeline_weights(
    tiny: dict[str, Path],  # noqa: F811
    tmp_path: Path,
    fmt: str,
    sym: str,
) -> None:
    """The checkpoint read back by our reader equals the library pipeline's own result on the
    same calibration batch, code for code and scale for scale."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infer_tool.calib.corpora import calibration_batch
    from infer_tool.calib.pipeline import quantize_model
    from infer_tool.packers.checkpoint import get_format, read_checkpoint

    out = tmp_path / "ckpt"
    code, _, stderr = quantize(tiny, out, *FEW, sym, "--format", fmt)
    assert code == 0, stderr
    _, read, _ = read_checkpoint(out)
    model = AutoModelForCausalLM.from_pretrained(tiny["model"], dtype=torch.float32).eval()
    ids = calibration_batch(AutoTokenizer.from_pretrained(tiny["model"]), str(tiny["calib"]), 4, 32, 0)
    scheme = make_scheme("autoround", group_size=32, iters=8, batch=2, symmetric=sym == "--sym")
    result = quantize_model(
        model, ids, scheme.for_storage(get_format(fmt, "int").scale_dtype or "float32"), device="cpu"
    )
    assert sorted(read) == sorted(result.quantized)
    for name, qw in result.quantized.items():
        assert torch.equal(read[name].dequantize(), qw.dequantize()), name


def test_same_seed_same_bytes_other_seed_other_rounding(tiny: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    for out, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        code, _, stderr = quantize(tiny, tmp_path / out, *FEW, "--batch-seed", seed)
        assert code == 0, stderr
    files = lambda d: (tmp_path / d / "model.safetensors").read_bytes()  # noqa: E731
    assert files("a") == files("b")
    assert files("a") != files("c")


def test_bad_input_exits_2_naming_why(tiny: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    (tmp_path / "stats").mkdir()
    (tmp_path / "stats" / "stats_index.json").write_text("{}")
    cases = [
        (
            ["--method", "autoround", "--stats", str(tmp_path / "stats")],
            "autoround tunes each block on its live inputs",
        ),
        (["--method", "autoround", "--iters", "0"], "--iters 0 is not supported"),
        (["--method", "autoround", "--lr", "-0.1"], "--lr -0.1 is not supported"),
        (["--method", "autoround", "--batch", "0"], "--batch 0 is not supported"),
        (["--method", "autoround", "--tune-dtype", "float16"], "--tune-dtype 'float16' is not supported"),
        (["--method", "gptq", "--iters", "5"], "--iters does not apply to --method gptq"),
    ]
    for extra, needle in cases:
        code, _, stderr = quantize(tiny, tmp_path / "x", *extra)
        assert code == 2, (extra, stderr)
        assert needle in stderr and "Traceback" not in stderr and stderr.count("\n") <= 2, (extra, stderr)
        assert not (tmp_path / "x").exists()


def test_killed_run_resumes_to_the_same_bytes(work: Path) -> None:  # noqa: F811
    """The fp chain the descent trains toward is saved with the run's progress: a run killed
    after its second layer, resumed, writes the uninterrupted run's bytes."""
    args = [
        "--calib",
        str(work / "calib.txt"),
        "--num-samples",
        "8",
        "--seq-len",
        "32",
        "--method",
        "autoround",
        "--group-size",
        "32",
        "--iters",
        "6",
        "--batch",
        "2",
        "--no-progress",
        "--device",
        "cpu",
        "--json",
    ]
    ref = _run(["quantize", str(work / "model"), "--out", str(work / "ar-ref"), *args])
    assert ref.returncode == 0, ref.stderr
    killed = _run(
        ["quantize", str(work / "model"), "--out", str(work / "ar"), *args], work / "driver.py", "after-layer", 2
    )
    assert killed.returncode == -9, killed.stderr
    resumed = _run(["quantize", str(work / "model"), "--out", str(work / "ar"), *args, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert _digests(work / "ar") == _digests(work / "ar-ref")
    assert json.loads(resumed.stdout)["autoround"] == json.loads(ref.stdout)["autoround"]
