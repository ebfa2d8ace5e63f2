"""`--gptaq` (GPTQ toward the fp model's output, GPTAQ's asymmetric calibration): the target
against an independent least-squares fit, dXXᵀ against a float64 formula, the solve's error
against the fp output, the pairing of the two chains in the pipeline, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_quantize_cli import one_thread, quantize, run, tiny  # noqa: F401  (fixtures)

from infer_tool.calib.stats import CrossAccumulator
from infer_tool.packers.gptq import gptaq_target, quantize_gptq
from infer_tool.schemes.integer import GPTQScheme


def _pair(K: int, T: int, N: int, seed: int, shift: float) -> tuple[torch.Tensor, ...]:
    """W (N, K), X (K, T) the quantized chain's inputs, X̃ = X + shift·noise the fp model's."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(K, T, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3.0, K, dtype=torch.float64)[:, None]
    X_fp = X + shift * torch.randn(K, T, generator=g, dtype=torch.float64)
    W = torch.randn(N, K, generator=g, dtype=torch.float64)
    return W, X, X_fp


def test_target_is_the_least_squares_fit_of_the_fp_output() -> None:
    W, X, X_fp = _pair(K=24, T=400, N=10, seed=0, shift=0.3)
    T = X.shape[1]
    H, dXXT = 2 * X @ X.T / T, 2 * (X_fp - X) @ X.T / T
    # independent: min over W' of ‖W'X − WX̃‖, by least squares on the tokens
    fit = torch.linalg.lstsq(X.T, (W @ X_fp).T).solution.T
    got = gptaq_target(W, H, dXXT, alpha=1.0, damp=1e-12)
    assert torch.allclose(got, fit, rtol=1e-8, atol=1e-9)
    half = gptaq_target(W, H, dXXT, alpha=0.25, damp=1e-12)
    assert torch.allclose(half, W + 0.25 * (fit - W), rtol=1e-8, atol=1e-9)
    # the same inputs on both chains: the target is W itself
    assert torch.equal(gptaq_target(W, H, torch.zeros_like(dXXT), alpha=1.0, damp=0.01), W)


def test_target_refuses_a_hessian_that_does_not_factorise() -> None:
    W = torch.randn(3, 4, dtype=torch.float64)
    H = -torch.eye(4, dtype=torch.float64)
    assert gptaq_target(W, H, torch.zeros(4, 4, dtype=torch.float64), alpha=1.0, damp=0.0) is None


@pytest.mark.parametrize("chunk_tokens", [7, 8192])
def test_cross_accumulator_against_fp64(chunk_tokens: int) -> None:
    g = torch.Generator().manual_seed(1)
    acc = CrossAccumulator(16, chunk_tokens=chunk_tokens)
    xs, fps = [], []
    for t in (5, 19, 12):  # chunks (b, t, K)
        x = torch.randn(2, t, 16, generator=g)
        x_fp = x + 0.1 * torch.randn(2, t, 16, generator=g)
        acc.add(x_fp, x)
        xs.append(x.reshape(-1, 16).double())
        fps.append(x_fp.reshape(-1, 16).double())
    X, X_fp = torch.cat(xs), torch.cat(fps)  # (T, K)
    ref = 2 * (X_fp - X).T @ X / X.shape[0]
    assert torch.allclose(acc.result().double(), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="paired inputs"):
        acc.add(torch.zeros(3, 16), torch.zeros(4, 16))


@pytest.mark.parametrize("symmetric", [True, False])
def test_solve_toward_the_target_lowers_the_error_against_the_fp_output(symmetric: bool) -> None:
    W, X, X_fp = _pair(K=64, T=2048, N=48, seed=2, shift=0.5)
    T = X.shape[1]
    H, dXXT = (2 * X @ X.T / T).float(), (2 * (X_fp - X) @ X.T / T).float()
    scheme = GPTQScheme(bits=4, group_size=32, symmetric=symmetric)
    target = W.float() @ X_fp.float()  # the fp model's output

    fit = gptaq_target(W.float(), H, dXXT, 1.0, scheme.damp)

    def excess(Wq: torch.Tensor) -> float:
        """‖ŴX − WX̃‖² above the unquantized best fit's (the part rounding can change)."""
        return float(((Wq @ X.float() - target) ** 2).sum() - ((fit @ X.float() - target) ** 2).sum())

    plain = quantize_gptq(W.float(), H, scheme).dequantize()
    toward = quantize_gptq(fit, H, scheme).dequantize()
    assert excess(toward) < 0.9 * excess(plain)  # measured 0.77x (sym) and 0.74x (asym)


def test_pipeline_pairs_the_chains_chunk_by_chunk(tiny: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    """Layer 0's q/k/v see the same inputs on both chains (nothing is quantized before
    them): their codes equal plain GPTQ's. Everything after differs."""
    from infer_tool.packers.checkpoint import read_checkpoint

    plain, gptaq = tmp_path / "plain", tmp_path / "gptaq"
    assert quantize(tiny, plain, "--method", "gptq", "--group-size", "32", "--json")[0] == 0
    code, out, err = quantize(tiny, gptaq, "--method", "gptq", "--group-size", "32", "--gptaq", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["scheme"]["gptaq"] == 1.0
    _, a, _ = read_checkpoint(plain)
    _, b, _ = read_checkpoint(gptaq)
    first = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    for n in first:
        assert torch.equal(a[n].q, b[n].q) and torch.equal(a[n].scale, b[n].scale), n
    assert all(not torch.equal(a[n].q, b[n].q) for n in a if n not in first)


def test_awq_gptq_pairs_in_the_folded_basis(tiny: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    """After AWQ's fold the live inputs are x / s: the fp ones must be divided alike. Layer
    0's q/k/v see the same x on both chains, so their target stays W up to float rounding of
    the folded norm: nearly every code equals awq+gptq's without --gptaq (undivided fp inputs
    would shift W* by a multiple of W and change most codes)."""
    from infer_tool.packers.checkpoint import read_checkpoint

    plain, gptaq = tmp_path / "plain", tmp_path / "gptaq"
    args = ("--method", "awq+gptq", "--group-size", "32")
    assert quantize(tiny, plain, *args)[0] == 0
    code, _, err = quantize(tiny, gptaq, *args, "--gptaq", "1")
    assert code == 0, err
    _, a, _ = read_checkpoint(plain)
    _, b, _ = read_checkpoint(gptaq)
    for n in (f"model.layers.0.self_attn.{p}_proj" for p in "qkv"):
        assert (a[n].q == b[n].q).float().mean() > 0.99, n
    later = [n for n in a if not n.startswith("model.layers.0.self_attn.")]
    assert sum(not torch.equal(a[n].q, b[n].q) for n in later) == len(later)


@pytest.mark.parametrize(
    "extra,needle",
    [
        (("--gptaq", "1.5"), "--gptaq 1.5 is not supported"),
        (("--gptaq", "0"), "--gptaq 0.0 is not supported"),
        (("--method", "awq", "--gptaq", "0.25"), "--gptaq does not apply to --method awq"),
        (("--fp4", "nvfp4", "--gptaq", "0.25"), "works with INT weights only"),
        (("--scheme", "W8A8", "--smoothquant", "0.5", "--gptaq", "0.25"), "does not go with --smoothquant"),
    ],
)
def test_bad_gptaq_is_refused_before_any_work(
    tiny: dict[str, Path],  # noqa: F811
    tmp_path: Path,
    extra: tuple[str, ...],
    needle: str,
) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = quantize(tiny, out, *(("--method", "gptq") if "--method" not in extra else ()), *extra)
    assert code == 2, stderr
    assert needle in stderr and "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_gptaq_from_saved_stats_is_refused(tiny: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    stats = tmp_path / "stats"
    code, _, err = run("calibrate", tiny["model"], "--calib", tiny["calib"], "--out", stats, "--num-samples", "4",
                       "--seq-len", "32", "--no-progress")  # fmt: skip
    assert code == 0, err
    code, _, err = quantize(tiny, tmp_path / "q", "--method", "gptq", "--gptaq", "0.25", "--stats", stats)
    assert code == 2 and "cannot run from --stats" in err, err


def test_gptaq_on_a_moe_model_is_refused(tiny: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_moe import save_moe

    model = save_moe(tmp_path / "moe", "qwen2_moe", seed=0)
    out = tmp_path / "out"
    code, _, err = run("quantize", model, "--calib", tiny["calib"], "--out", out, "--num-samples", "4", "--seq-len",
                       "32", "--no-progress", "--method", "gptq", "--group-size", "16", "--gptaq", "0.25")  # fmt: skip
    assert code == 2 and "does not cover mixture-of-experts" in err and "Traceback" not in err, err
    assert not out.exists()
