"""`infer-tool quantize --fp4`: the FP4 schemes (NVFP4 / MXFP4, weights only and W4A4) with
RTN, GPTQ, AWQ, AWQ+GPTQ and AutoRound, on tiny random models, end to end: the registry's method x format classes,
the solvers against references, fused shards sharing one global scale (and vLLM's collapse of
them changing nothing), W4A4 input scales, the checkpoint read back by transformers +
compressed-tensors (logits equal ours) and by `eval ppl` (equal to `--eval`), and bad input.
The numerics themselves are tests/test_fp4.py's."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tiny import TEXT, save_tiny_llama  # noqa: E402
from tiny_moe import save_moe  # noqa: E402

from infer_tool.cli.app import app  # noqa: E402
from infer_tool.common.errors import BadInput  # noqa: E402
from infer_tool.kernels.fp4_layout import GROUP_SIZE  # noqa: E402
from infer_tool.packers import fp4  # noqa: E402
from infer_tool.packers.awq import apply_awq_clip, awq_search_clip, awq_search_scale  # noqa: E402
from infer_tool.packers.fp4_solve import fake_quantize_shards, quantize_fp4_gptq, quantize_fp4_rtn  # noqa: E402
from infer_tool.schemes.fp4 import FP4_GROUP_SIZE, Fp4AWQScheme, Fp4GPTQScheme, Fp4RTNScheme  # noqa: E402
from infer_tool.schemes.integer import AWQScheme, GPTQScheme, RTNScheme  # noqa: E402
from infer_tool.schemes.registry import make_scheme  # noqa: E402

runner = CliRunner()
TINY = ("--num-samples", "8", "--seq-len", "32", "--no-progress", "--device", "cpu", "--json")
EVAL = ("--eval-tokens", "256", "--eval-seq-len", "64")
AUTOROUND_FEW = ("--method", "autoround", "--iters", "5", "--batch", "4", "--lr", "0.05")
# name -> quantize flags; every run also evaluates (--eval)
RUNS = {
    "rtn-nvfp4-a16": ("--method", "rtn", "--fp4", "nvfp4"),
    "rtn-nvfp4-w4a4": ("--method", "rtn", "--fp4", "nvfp4", "--fp4-activations", "fp4"),
    "gptq-nvfp4-w4a4": ("--method", "gptq", "--fp4", "nvfp4", "--fp4-activations", "fp4"),
    "awq-nvfp4-a16": ("--method", "awq", "--fp4", "nvfp4"),
    "awq+gptq-nvfp4-w4a4": ("--method", "awq+gptq", "--fp4", "nvfp4", "--fp4-activations", "fp4"),
    "gptq-mxfp4-w4a4-mse": ("--method", "gptq", "--fp4", "mxfp4", "--fp4-activations", "fp4", "--observer", "mse"),
    # lr 0.05: at 1/iters the tiny model's five steps never beat RTN (tests/test_guard.py)
    "autoround-nvfp4-w4a4": (*AUTOROUND_FEW, "--fp4", "nvfp4", "--fp4-activations", "fp4"),
    "autoround-mxfp4-a16": (*AUTOROUND_FEW, "--fp4", "mxfp4"),
}
QKV = ("q_proj", "k_proj", "v_proj")


@pytest.fixture(autouse=True, scope="module")
def one_thread():  # noqa: ANN201
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def invoke(*args: object) -> tuple[int, str]:
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout if r.exit_code == 0 else r.output


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:  # noqa: ANN001
    root = tmp_path_factory.mktemp("fp4")
    (root / "corpus.txt").write_text(TEXT * 4)
    save_tiny_llama(root / "model", tie=False)
    out = {"root": root}
    for name, flags in RUNS.items():
        code, text = invoke(
            "quantize",
            root / "model",
            "--calib",
            root / "corpus.txt",
            "--out",
            root / name,
            "--eval",
            root / "corpus.txt",
            *EVAL,
            *TINY,
            *flags,
        )
        assert code == 0, text
        out[name] = json.loads(text)
    return out


def tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


# ---------------------------------------------------------------- schemes and options


def test_method_picks_the_fp4_class_with_the_int_methods_defaults() -> None:
    assert type(make_scheme("rtn", fp4="nvfp4")) is Fp4RTNScheme and type(make_scheme("rtn")) is RTNScheme
    gptq, awq = make_scheme("gptq", fp4="mxfp4"), make_scheme("awq", fp4_activations="fp4")
    assert type(gptq) is Fp4GPTQScheme and (gptq.damp, gptq.block_size, gptq.act_order) == (
        GPTQScheme().damp,
        GPTQScheme().block_size,
        GPTQScheme().act_order,
    )
    assert type(awq) is Fp4AWQScheme and (awq.fp4, awq.grid, awq.search, awq.clip) == (
        "nvfp4",
        AWQScheme().grid,
        AWQScheme().search,
        AWQScheme().clip,
    )
    assert FP4_GROUP_SIZE == GROUP_SIZE and gptq.group_size == 32 and awq.group_size == 16
    assert (make_scheme("rtn", fp4="nvfp4").preset, awq.preset, gptq.preset) == ("NVFP4A16", "NVFP4", "MXFP4A16")
    with pytest.raises(BadInput, match="damp=0 is not supported"):  # GPTQ's own check
        make_scheme("gptq", fp4="nvfp4", damp=0)
    with pytest.raises(BadInput, match="no 'gptq' scheme takes all of bits, fp4 together"):
        make_scheme("gptq", fp4="nvfp4", bits=4)


def test_awq_clip_search_defaults_to_off_for_mxfp4_only() -> None:
    """INT and NVFP4 AWQ search the clip by default, MXFP4 does not; `clip` given wins for both."""
    assert make_scheme("awq").clip and make_scheme("awq", fp4="nvfp4").clip
    assert make_scheme("awq", fp4="mxfp4").clip is False
    assert make_scheme("awq", fp4="mxfp4", clip=True).clip is True
    assert make_scheme("awq", fp4="nvfp4", clip=False).clip is False
    assert make_scheme("awq", fp4="mxfp4") == make_scheme("awq", fp4="mxfp4", clip=False)


@pytest.mark.parametrize(
    ("fmt", "flags", "searched"),
    [("mxfp4", (), False), ("mxfp4", ("--awq-clip",), True), ("nvfp4", (), True), ("nvfp4", ("--no-awq-clip",), False)],
)
def test_the_clip_search_runs_as_the_format_and_flag_say(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, flags: tuple[str, ...], searched: bool
) -> None:
    import infer_tool.calib.quantizers.fp4 as fp4_quantizers

    calls = []
    search = fp4_quantizers.awq_search_clip
    monkeypatch.setattr(fp4_quantizers, "awq_search_clip", lambda *a, **k: calls.append(a[0].shape) or search(*a, **k))
    (tmp_path / "corpus.txt").write_text(TEXT)
    save_tiny_llama(tmp_path / "model")
    out = tmp_path / "out"
    code, text = invoke(
        "quantize",
        tmp_path / "model",
        "--calib",
        tmp_path / "corpus.txt",
        "--out",
        out,
        "--method",
        "awq",
        "--fp4",
        fmt,
        *flags,
        *TINY,
    )
    assert code == 0, text
    assert bool(calls) is searched, calls


def test_awq_clip_flags_are_refused_by_other_methods(tmp_path: Path) -> None:
    code, text = invoke(
        "quantize", tmp_path / "no-model", "--out", tmp_path / "out", "--method", "gptq", "--no-awq-clip"
    )
    assert code == 2 and "--no-awq-clip does not apply to --method gptq (only to --method awq)" in text  # as typed
    assert "Traceback" not in text and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--fp4", "nvfp4", "--group-size", "16"),
            "--fp4 does not go with --group-size: they set two number formats of --method awq",
        ),
        (  # a two-way flag is named as typed
            ("--method", "autoround", "--fp4", "nvfp4", "--asym"),
            "--fp4 does not go with --asym: they set two number formats of --method autoround",
        ),
        (
            ("--method", "autoround", "--fp4", "mxfp4", "--no-full-range"),
            "--fp4 does not go with --no-full-range: they set two number formats of --method autoround",
        ),
        (
            ("--method", "fp8", "--fp4", "nvfp4"),
            "--fp4 does not apply to --method fp8 (only to --method autoround / awq / awq+gptq / gptq / rtn)",
        ),
        (("--fp4", "nvfp8"), "--fp4 'nvfp8' is not supported; use one of nvfp4, mxfp4"),
        (("--fp4", "nvfp4", "--fp4-activations", "fp8"), "--fp4-activations 'fp8' is not supported; use none"),
        (
            ("--fp4", "nvfp4", "--observer", "percentile"),
            "--observer 'percentile' is not supported; use one of minmax, mse",
        ),
        (
            ("--method", "autoround", "--fp4", "nvfp4", "--observer", "mse"),
            "--observer mse does not go with --method autoround",
        ),
        (
            ("--fp4", "mxfp4", "--format", "awq"),
            "format 'awq' is not supported for fp4 weights; use one of compressed-tensors",
        ),
        (
            ("--fp4", "nvfp4", "--format", "fp8"),
            "format 'fp8' is not supported for fp4 weights; use one of compressed-tensors",
        ),
    ],
)
def test_bad_fp4_options_exit_2_in_one_line_before_any_work(
    tmp_path: Path, flags: tuple[str, ...], message: str
) -> None:
    code, text = invoke("quantize", tmp_path / "no-model", "--out", tmp_path / "out", *flags)
    assert code == 2 and message in text and "Traceback" not in text
    assert not (tmp_path / "out").exists()


def test_k_not_a_multiple_of_the_group_is_refused(tmp_path: Path) -> None:
    """hidden 40: q/k/v/gate/up read K = 40, no multiple of 16 (NVFP4) nor of 32 (MXFP4)."""
    (tmp_path / "corpus.txt").write_text(TEXT)
    save_tiny_llama(tmp_path / "model", hidden=40)
    for f, g in (("nvfp4", 16), ("mxfp4", 32)):
        code, text = invoke(
            "quantize", tmp_path / "model", "--calib", tmp_path / "corpus.txt", "--out", tmp_path / f, "--fp4", f, *TINY
        )
        assert code == 2 and f"{f} scales groups of {g} input features, which do not divide those of" in text
        assert "(K=40)" in text and "Traceback" not in text and not (tmp_path / f).exists()


def test_demo_defaults_keep_fp4_groups() -> None:
    from infer_tool.calib.recipe import apply_demo, merge, scheme_from_options

    opts = apply_demo(merge({}, {"fp4": "mxfp4"}), given={"fp4"})
    assert opts.group_size is None and scheme_from_options(opts).group_size == 32


# ---------------------------------------------------------------- solvers


def _correlated(t: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, k, generator=g) @ (torch.eye(k) + 0.3 * torch.randn(k, k, generator=g))


def _outlier_channels(t: int, k: int, seed: int) -> torch.Tensor:
    """Correlated inputs whose channels' magnitudes vary by e^N(0,1) (AWQ's salient channels)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5
    X = torch.randn(t, k, generator=g) @ mix + 0.1 * torch.randn(t, k, generator=g)
    return X * torch.exp(torch.randn(k, generator=g))


def _out_err(X: torch.Tensor, W: torch.Tensor, W_hat: torch.Tensor) -> float:
    return float((X @ (W_hat - W).T).norm() / (X @ W.T).norm())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rtn_is_the_packers_min_max_quantizer(fmt: str, dtype: str) -> None:
    """The solver's bytes are `fp4.nvfp4_quantize` / `mxfp4_quantize`'s (compressed-tensors'
    own bytes: tests/test_fp4.py), with the amax arithmetic in the checkpoint dtype."""
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(1)).to(getattr(torch, dtype))
    ours = quantize_fp4_rtn(w.float(), None, Fp4RTNScheme(fp4=fmt, amax_dtype=dtype))
    if fmt == "nvfp4":
        codes, scale, gs = fp4.nvfp4_quantize(w)
        assert torch.equal(ours.global_scale, gs)
    else:
        (codes, scale), gs = fp4.mxfp4_quantize(w), None
        assert ours.global_scale is None
    assert torch.equal(ours.codes, codes) and torch.equal(ours.w_scale.view(torch.uint8), scale.view(torch.uint8))


def _gptq_float64(W: torch.Tensor, H: torch.Tensor, eff: torch.Tensor, g: int, damp: float) -> torch.Tensor:
    """GPTQ without lazy batches, in float64, every column rounded with its fixed group scale."""
    W = W.double().clone()
    H = H.double().clone()
    H += damp * torch.diag(H).mean() * torch.eye(H.shape[0], dtype=torch.float64)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    s = eff.double().repeat_interleave(g, dim=1)
    Q = torch.zeros_like(W)
    for j in range(W.shape[1]):
        q = fp4.round_to_e2m1(W[:, j] / s[:, j]) * s[:, j]
        Q[:, j] = q
        W[:, j + 1 :] -= ((W[:, j] - q) / U[j, j]).unsqueeze(1) * U[j, j + 1 :].unsqueeze(0)
    return Q


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gptq_on_the_fp4_grid_matches_a_float64_reference_and_beats_rtn(fmt: str) -> None:
    """Without act-order the solver is the plain float64 loop (codes equal but for rounding
    ties, >= 99%; output error within 2%); act-order (static groups: the same scales) and
    plain GPTQ both stay at most 0.75x RTN's output error on correlated inputs."""
    W = torch.randn(32, 256, generator=torch.Generator().manual_seed(2))
    X = _correlated(1024, 256, seed=2)
    H = 2 * X.T @ X / X.shape[0]
    scheme = Fp4GPTQScheme(fp4=fmt, act_order=False)
    ours = quantize_fp4_gptq(W, H, scheme)
    rtn = quantize_fp4_rtn(W, None, scheme)
    assert torch.equal(ours.w_scale.view(torch.uint8), rtn.w_scale.view(torch.uint8))  # static: the original weights'
    ref = _gptq_float64(W, H, ours.effective_scale(), FP4_GROUP_SIZE[fmt], scheme.damp)
    got = ours.dequantize()
    assert float((got == ref.float()).float().mean()) >= 0.99
    assert abs(_out_err(X, W, got) - _out_err(X, W, ref.float())) <= 0.02 * _out_err(X, W, ref.float())
    e_rtn = _out_err(X, W, rtn.dequantize())
    assert _out_err(X, W, got) < 0.75 * e_rtn
    ordered = quantize_fp4_gptq(W, H, Fp4GPTQScheme(fp4=fmt, act_order=True))
    assert torch.equal(ordered.w_scale.view(torch.uint8), rtn.w_scale.view(torch.uint8))
    assert _out_err(X, W, ordered.dequantize()) < 0.75 * e_rtn
    assert ordered.info["fallback"] is None and ordered.info["loss"] > 0


def test_gptq_falls_back_to_fp4_rtn_with_the_given_global_scale() -> None:
    W = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    gs = torch.tensor([1234.0])
    w = quantize_fp4_gptq(W, -torch.eye(64), Fp4GPTQScheme(), global_scale=gs)
    assert w.info["fallback"] == "rtn" and w.info["reason"].startswith("Cholesky failed")
    assert torch.equal(w.codes, quantize_fp4_rtn(W, None, Fp4RTNScheme(), global_scale=gs).codes)
    assert torch.equal(w.global_scale, gs)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_mse_observer_never_loses_to_min_max_on_the_stored_scales(fmt: str) -> None:
    """Per group, the MSE observer's stored scale has |error|^2.4 at most min-max's (the grid
    holds min-max itself); on Gaussian weights lower in total: by at least 3% for NVFP4, and at
    all for MXFP4 (a power-of-two scale moves only where the shrink crosses a binade)."""
    W = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    g = FP4_GROUP_SIZE[fmt]

    def err(w: torch.Tensor) -> torch.Tensor:
        return (w.dequantize() - W).abs().pow(2.4).reshape(64, -1, g).sum(-1)

    mse = err(quantize_fp4_rtn(W, None, Fp4RTNScheme(fp4=fmt, observer="mse")))
    minmax = err(quantize_fp4_rtn(W, None, Fp4RTNScheme(fp4=fmt)))
    assert bool((mse <= minmax * (1 + 1e-6)).all())
    assert float(mse.sum()) < (0.97 if fmt == "nvfp4" else 1.0) * float(minmax.sum())


@pytest.mark.parametrize(("fmt", "margin"), [("nvfp4", 0.85), ("mxfp4", 0.98)])
def test_awq_searches_scored_by_fp4_beat_rtn_on_salient_channels(fmt: str, margin: float) -> None:
    """AWQ's scale + clip search with the FP4 quantizer: output error at most `margin` x FP4
    RTN's on inputs with salient channels (observed 0.73x NVFP4; 0.95x MXFP4, whose
    power-of-two group scales leave AWQ's scales less to win)."""
    gen = torch.Generator().manual_seed(5)
    W = torch.randn(64, 256, generator=gen)
    X = _outlier_channels(1024, 256, seed=5)
    scheme = Fp4AWQScheme(fp4=fmt, search="full")
    ref = X @ W.T
    found = awq_search_scale(
        X.abs().mean(0), [W], lambda eff: X @ eff[0].T, ref, scheme, qdq=lambda ws: fake_quantize_shards(ws, scheme)
    )
    assert found.best_loss < found.rtn_loss
    Ws, Xs = W * found.scales, X / found.scales
    gs = fp4.nvfp4_fused_global_scale(Ws) if fmt == "nvfp4" else None
    Wc = apply_awq_clip(Ws, awq_search_clip(Ws, Xs, scheme, qdq_rows=lambda w: fp4.fake_quantize_weight(w, fmt, gs)))
    e_awq = _out_err(Xs, Ws, quantize_fp4_rtn(Wc, None, scheme, global_scale=gs).dequantize())
    e_rtn = _out_err(X, W, quantize_fp4_rtn(W, None, scheme).dequantize())
    assert e_awq < margin * e_rtn


# ---------------------------------------------------------------- the pipeline end to end


def test_gptq_beats_rtn_on_the_tiny_model(runs: dict) -> None:
    """Mean per-layer output error: GPTQ at most 0.75x RTN's (NVFP4, the same W4A4 scheme)."""
    assert runs["gptq-nvfp4-w4a4"]["layer_error_mean"] < 0.75 * runs["rtn-nvfp4-w4a4"]["layer_error_mean"]
    assert runs["awq-nvfp4-a16"]["layer_error_mean"] < runs["rtn-nvfp4-a16"]["layer_error_mean"]
    assert runs["awq+gptq-nvfp4-w4a4"]["layer_error_mean"] < 0.75 * runs["rtn-nvfp4-w4a4"]["layer_error_mean"]


@pytest.mark.parametrize("name", ["autoround-nvfp4-w4a4", "autoround-mxfp4-a16"])
def test_autoround_descent_lowers_every_block_loss_on_the_fp4_grid(runs: dict, name: str) -> None:
    """Each block's kept batch loss is below plain FP4 RTN's (step 0) by 10% or more."""
    entries = runs[name]["autoround"]
    assert len(entries) == 2 and all(e["best_loss"] < 0.9 * e["rtn_loss"] for e in entries), entries
    assert "autoround" in runs[name]["scheme_description"] and runs[name]["scheme"]["fp4"] in name


@pytest.mark.parametrize("name", list(RUNS))
def test_checkpoint_layout_and_config_are_llm_compressors(runs: dict, name: str) -> None:
    root, rep = runs["root"], runs[name]
    fmt = "mxfp4" if "mxfp4" in name else "nvfp4"
    w4a4 = "w4a4" in name
    g = FP4_GROUP_SIZE[fmt]
    qc = json.loads((root / name / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert qc["format"] == group["format"] == f"{fmt}-pack-quantized" and qc["ignore"] == ["lm_head"]
    w = group["weights"]
    assert (w["type"], w["num_bits"], w["group_size"], w["symmetric"], w["dynamic"]) == ("float", 4, g, True, False)
    assert (w["strategy"], w["scale_dtype"]) == (
        ("tensor_group", "torch.float8_e4m3fn") if fmt == "nvfp4" else ("group", "torch.uint8")
    )
    assert w["actorder"] == ("static" if "gptq" in name.split("-")[0] else None)
    assert w["observer"] == ("memoryless_mse" if name.endswith("mse") else "memoryless_minmax")
    inputs = group["input_activations"]
    assert (inputs is not None) == w4a4
    if w4a4:
        assert inputs["dynamic"] == ("local" if fmt == "nvfp4" else True) and inputs["group_size"] == g
    t = tensors(root / name)
    linears = sorted(k.removesuffix(".weight_packed") for k in t if k.endswith(".weight_packed"))
    assert len(linears) == rep["quantized_layers"] == 14 and not any(k.endswith(".weight") and "proj" in k for k in t)
    for n in linears:
        N, K = t[f"{n}.weight_packed"].shape[0], 2 * t[f"{n}.weight_packed"].shape[1]
        assert t[f"{n}.weight_packed"].dtype == torch.uint8 and t[f"{n}.weight_scale"].shape == (N, K // g)
        assert t[f"{n}.weight_scale"].dtype == (torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8)
        assert (f"{n}.weight_global_scale" in t) == (fmt == "nvfp4") and f"{n}.weight_shape" not in t
        assert (f"{n}.input_global_scale" in t) == (w4a4 and fmt == "nvfp4")


@pytest.mark.parametrize(
    "name,weights", [("rtn-nvfp4-a16", "nvfp4a16"), ("rtn-nvfp4-w4a4", "nvfp4"), ("gptq-mxfp4-w4a4-mse", "mxfp4")]
)
def test_kv_budget_weights_count_the_checkpoints_real_bytes(runs: dict, name: str, weights: str) -> None:
    """`kv-budget --weights nvfp4|nvfp4a16|mxfp4` (an estimate from config.json) counts exactly the
    bytes the checkpoint's quantized linears hold on disk (values, group scales, global and input
    global scales), and leaves 16-bit exactly the parameters the quantizer left unquantized."""
    from infer_tool.common.safetensors_header import tensor_headers
    from infer_tool.sizing.hf_config import load_config, shape_from_config
    from infer_tool.sizing.weights import weight_bytes

    path = runs["root"] / name
    headers = {k: v for k, v in tensor_headers(path / "model.safetensors")[0].items() if k != "__metadata__"}
    linears = {k.removesuffix(".weight_packed") for k in headers if k.endswith(".weight_packed")}
    size = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in headers.items()}
    packed = sum(b for k, b in size.items() if k.rsplit(".", 1)[0] in linears)
    rest = {k: v for k, v in headers.items() if k.rsplit(".", 1)[0] not in linears}
    rest_params = sum(math.prod(v["shape"]) for v in rest.values())
    wb = weight_bytes(shape_from_config(load_config(path), name=name).params, weights)
    assert len(linears) == 14 and wb.quantized == packed
    assert wb.unquantized == 2 * rest_params
    code, text = invoke("kv-budget", path, "--weights", weights, "--json")
    assert code == 0, text
    assert json.loads(text)["weights"]["bytes_total"] == packed + 2 * rest_params


def _fused(names: list[str]) -> list[list[str]]:
    """q/k/v and gate/up of each layer (dense)."""
    layers = sorted({n.rsplit(".", 2)[0] for n in names})
    return [[f"{p}.self_attn.{x}" for x in QKV] for p in layers] + [
        [f"{p}.mlp.{x}" for x in ("gate_proj", "up_proj")] for p in layers
    ]


@pytest.mark.parametrize(
    "name", ["rtn-nvfp4-w4a4", "gptq-nvfp4-w4a4", "awq-nvfp4-a16", "awq+gptq-nvfp4-w4a4", "autoround-nvfp4-w4a4"]
)
def test_fused_shards_share_one_global_scale_so_vllms_collapse_changes_nothing(runs: dict, name: str) -> None:
    """vLLM keeps one global scale per fused q/k/v, gate/up (the shards' max,
    `CompressedTensorsW4A4Fp4.process_weights_after_loading`): dequantizing each shard with it
    gives the shard's own weights bit for bit. Counterfactual: had q/k/v kept their own global
    scales, that collapse would change them."""
    t = tensors(runs["root"] / name)
    names = [k.removesuffix(".weight_packed") for k in t if k.endswith(".weight_packed")]
    for group in _fused(names):
        gs = torch.stack([t[f"{n}.weight_global_scale"] for n in group])
        assert bool((gs == gs[0]).all()), group
        kept = gs.max().reshape(1)
        for n in group:
            own = fp4.effective_scale(t[f"{n}.weight_scale"], t[f"{n}.weight_global_scale"])
            assert torch.equal(fp4.effective_scale(t[f"{n}.weight_scale"], kept), own)
        if "w4a4" in name:  # one input, one input global scale
            igs = torch.stack([t[f"{n}.input_global_scale"] for n in group])
            assert bool((igs == igs[0]).all()) and 0 < float(igs[0]) < float("inf")
    src = tensors(runs["root"] / "model")
    q, k = (src[f"model.layers.0.self_attn.{x}.weight"] for x in ("q_proj", "k_proj"))
    own = [fp4.nvfp4_quantize(w) for w in (q, k)]
    assert own[0][2] != own[1][2]
    collapsed = torch.maximum(own[0][2], own[1][2])
    changed = [not torch.equal(fp4.effective_scale(s, collapsed), fp4.effective_scale(s, g)) for _, s, g in own]
    assert any(changed)


@pytest.mark.parametrize("name", ["rtn-nvfp4-w4a4", "gptq-nvfp4-w4a4", "autoround-nvfp4-w4a4"])
def test_w4a4_input_global_scale_is_448x6_over_the_inputs_max(runs: dict, name: str) -> None:
    """An NVFP4 W4A4 linear's input_global_scale = 448·6 / max|x| of its calibration inputs: for
    layer 0's q/k/v, the input norm of the calibration tokens' embeddings, recomputed here."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infer_tool.calib.corpora import calibration_batch

    root = runs["root"]
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    ids = calibration_batch(AutoTokenizer.from_pretrained(root / "model"), str(root / "corpus.txt"), 8, 32, 0)
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    expect = fp4.nvfp4_global_scale(x.abs().amax().reshape(1))
    t = tensors(root / name)
    for p in QKV:
        assert float(t[f"model.layers.0.self_attn.{p}.input_global_scale"]) == pytest.approx(float(expect), rel=1e-6)


@pytest.mark.parametrize("name", list(RUNS))
def test_eval_ppl_of_the_checkpoint_is_the_quantizers_own(runs: dict, name: str) -> None:
    """`eval ppl` (Fp4Linear, W4A4 inputs quantized as vLLM's emulation) = `--eval`'s ppl of the
    in-memory model (the solver's weights, the same activation rule), to fp32 summation order."""
    root = runs["root"]
    code, text = invoke(
        "eval",
        "ppl",
        root / name,
        "--data",
        root / "corpus.txt",
        "--max-tokens",
        "256",
        "--seq-len",
        "64",
        "--json",
        "--no-progress",
        "--device",
        "cpu",
    )
    assert code == 0, text
    ev = json.loads(text)
    assert ev["ppl"] == pytest.approx(runs[name]["eval"]["ppl_after"], rel=1e-6)
    assert "vLLM 0.32's CPU emulation" in runs[name]["eval"]["evaluated"]
    # both say what was done to the activations: the FP4 rule for W4A4, nothing for A16
    w4a4 = "w4a4" in name
    assert (
        ev["activations"]
        == runs[name]["eval"]["activations"]
        == (f"{name.split('-')[1]} W4A4 (vLLM's emulation)" if w4a4 else "unquantized")
    )


@pytest.mark.parametrize(
    "name",
    [
        "rtn-nvfp4-a16",
        "gptq-nvfp4-w4a4",
        "awq-nvfp4-a16",
        "awq+gptq-nvfp4-w4a4",
        "gptq-mxfp4-w4a4-mse",
        "autoround-nvfp4-w4a4",
        "autoround-mxfp4-a16",
    ],
)
def test_transformers_with_compressed_tensors_gives_our_logits(runs: dict, name: str) -> None:
    """transformers + compressed-tensors decompresses the checkpoint itself (into bfloat16, the
    only dtype its FP4 decompression writes) and fake-quantizes W4A4 inputs; its logits equal a
    bf16 model holding our dequantized weights (and our compressed-tensors-rule activation
    quantization) to 1e-3 of the largest logit (without the activation quantization they differ
    by about 1%)."""
    from transformers import AutoModelForCausalLM

    from infer_tool.packers.checkpoint import read_checkpoint

    root = runs["root"]
    hf = AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.bfloat16)
    assert hasattr(hf.model.layers[0].self_attn.q_proj, "weight_packed")  # compressed-tensors runs it
    _, layers, rest = read_checkpoint(root / name)
    ref = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.bfloat16)
    ref.load_state_dict({k: v.to(torch.bfloat16) for k, v in rest.items()}, strict=False)  # AWQ's folded norms
    for n, w in layers.items():
        m = ref.get_submodule(n)
        m.weight.data = w.dequantize(torch.bfloat16)
        if w.activations == "fp4":
            if w.fmt == "nvfp4":

                def quant(x, igs=w.input_global_scale):
                    return fp4.nvfp4_fake_quantize_input(x, igs, rule="compressed-tensors")
            else:
                quant = fp4.mxfp4_fake_quantize_input
            m.register_forward_pre_hook(lambda mod, args, quant=quant: (quant(args[0]),))
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = hf(ids).logits.float(), ref(ids).logits.float()
    assert float((a - b).abs().max()) <= 1e-3 * float(b.abs().max())


def test_w4a4_from_saved_statistics_and_statistics_without_ranges(runs: dict, tmp_path: Path) -> None:
    """--stats: the input global scales come from the saved max |x| (exactly); a statistics
    directory whose layers lack it is refused before any work (exit 2, one line)."""
    root = runs["root"]
    code, text = invoke(
        "calibrate",
        root / "model",
        "--calib",
        root / "corpus.txt",
        "--out",
        tmp_path / "stats",
        "--num-samples",
        "8",
        "--seq-len",
        "32",
        "--no-progress",
        "--device",
        "cpu",
    )
    assert code == 0, text
    code, text = invoke(
        "quantize",
        root / "model",
        "--stats",
        tmp_path / "stats",
        "--out",
        tmp_path / "q",
        *TINY,
        "--method",
        "gptq",
        "--fp4",
        "nvfp4",
        "--fp4-activations",
        "fp4",
    )
    assert code == 0, text
    index = json.loads((tmp_path / "stats" / "stats_index.json").read_text())
    t = tensors(tmp_path / "q")
    for n, entry in index["layers"].items():
        expect = fp4.nvfp4_global_scale(torch.tensor([entry["act_abs_max"]], dtype=torch.float32))
        assert torch.equal(t[f"{n}.input_global_scale"], expect), n
    del index["layers"]["model.layers.1.mlp.down_proj"]["act_abs_max"]
    (tmp_path / "stats" / "stats_index.json").write_text(json.dumps(index))
    code, text = invoke(
        "quantize",
        root / "model",
        "--stats",
        tmp_path / "stats",
        "--out",
        tmp_path / "q2",
        *TINY,
        "--method",
        "rtn",
        "--fp4",
        "nvfp4",
        "--fp4-activations",
        "fp4",
    )
    assert code == 2 and "have no activation range" in text and "model.layers.1.mlp.down_proj" in text
    assert len(text.strip().splitlines()) == 1 and not (tmp_path / "q2").exists()


@pytest.mark.parametrize("method", ["gptq", "awq+gptq", "autoround"])
def test_moe_experts_share_w1_w3_scales_and_one_input_scale_per_layer(tmp_path: Path, method: str) -> None:
    """Qwen2-MoE (a shared expert), GPTQ (AWQ+GPTQ, AutoRound) NVFP4 W4A4: every expert quantized, the routers left
    out; each expert's gate/up share one global scale (vLLM's MoE uses w1's for w13, which then
    changes nothing), every routed expert of a layer has one input global scale for gate/up and
    one for down (vLLM keeps their max), the shared expert its own; `eval ppl` of the checkpoint
    equals `--eval`'s."""
    (tmp_path / "corpus.txt").write_text(TEXT * 4)
    save_moe(tmp_path / "moe", "qwen2_moe")
    code, text = invoke(
        "quantize",
        tmp_path / "moe",
        "--calib",
        tmp_path / "corpus.txt",
        "--out",
        tmp_path / "q",
        "--eval",
        tmp_path / "corpus.txt",
        *EVAL,
        *TINY,
        *(AUTOROUND_FEW if method == "autoround" else ("--method", method)),
        "--fp4",
        "nvfp4",
        "--fp4-activations",
        "fp4",
    )
    assert code == 0, text
    ppl = json.loads(text)["eval"]["ppl_after"]
    code, text = invoke(
        "eval",
        "ppl",
        tmp_path / "q",
        "--data",
        tmp_path / "corpus.txt",
        "--max-tokens",
        "256",
        "--seq-len",
        "64",
        "--json",
        "--no-progress",
        "--device",
        "cpu",
    )
    assert code == 0 and json.loads(text)["ppl"] == pytest.approx(ppl, rel=1e-6), text  # our loader reads every expert
    t = tensors(tmp_path / "q")
    ignore = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["ignore"]
    assert {f"model.layers.{i}.mlp.gate" for i in range(2)} <= set(ignore)
    experts = sorted({m.group(0) for k in t if (m := re.match(r".*\.experts\.\d+", k))})
    assert len(experts) == 8
    for e in experts:
        gate, up, down = (f"{e}.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
        assert torch.equal(t[f"{gate}.weight_global_scale"], t[f"{up}.weight_global_scale"])
        w1 = t[f"{gate}.weight_global_scale"]
        assert torch.equal(
            fp4.effective_scale(t[f"{up}.weight_scale"], w1),
            fp4.effective_scale(t[f"{up}.weight_scale"], t[f"{up}.weight_global_scale"]),
        )
        assert f"{down}.weight_global_scale" in t
    for layer in range(2):
        mine = [e for e in experts if e.startswith(f"model.layers.{layer}.")]
        for projs in (("gate_proj", "up_proj"), ("down_proj",)):
            igs = {float(t[f"{e}.{p}.input_global_scale"]) for e in mine for p in projs}
            assert len(igs) == 1 and 1.0 < igs.pop() < float("inf")
        shared = f"model.layers.{layer}.mlp.shared_expert"
        assert torch.equal(t[f"{shared}.gate_proj.input_global_scale"], t[f"{shared}.up_proj.input_global_scale"])
