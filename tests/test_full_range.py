"""The signed full-range grid of symmetric INT groups (`--full-range`, `packers/rtn.qparams`):
the definition against a per-group reference written here, every solver on it, every format
carrying its negative scales, and the readers users load them with (transformers +
compressed-tensors here; vLLM's CPU build in tests/test_vllm.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_quantize_cli import one_thread, quantize, reference_model, tiny  # noqa: F401  (fixtures)

from infer_tool.packers.autoround import Grouped, Rounding, fake_quantize_rounding, quantize_rounding
from infer_tool.packers.checkpoint import read_checkpoint
from infer_tool.packers.gptq import quantize_gptq
from infer_tool.packers.rtn import mse_qparams, qparams, quantize_codes, quantize_rtn
from infer_tool.schemes.registry import make_scheme


def groups(n: int = 40, g: int = 32, seed: int = 0) -> torch.Tensor:
    """(n, 2, g) groups of different ranges, with the cases the sign rule decides on: all
    zero, one side only, and the two sides tied."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, 2, g, generator=gen) * torch.rand(n, 1, 1, generator=gen)
    w[0, 0] = 0.0
    w[1, 0] = w[1, 0].abs()  # positive only
    w[2, 0] = -w[2, 0].abs()  # negative only
    w[3, 0, 0], w[3, 0, 1] = 0.75, -0.75  # tied sides
    w[3, 0, 2:] = w[3, 0, 2:].clamp(-0.5, 0.5)
    return w


def reference(group: list[float], bits: int) -> tuple[float, list[int]]:
    """One group by the definition: the larger side (the positive one on a tie) at level
    −2^(b−1), scale = ±max / 2^(b−1), codes round(w / scale) + 2^(b−1) clamped to the grid."""
    half = 1 << (bits - 1)
    neg, pos = max(-min(group), 0.0), max(max(group), 0.0)
    scale = (neg if pos < neg else -pos) / half
    if scale == 0.0:
        scale = 1.0
    return scale, [min(max(round(w / scale) + half, 0), 2 * half - 1) for w in group]


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_qparams_full_range_is_the_definition(bits: int) -> None:
    """Tolerance: exact (float32 arithmetic of the same quotients; round-half-even on both sides)."""
    w = groups()
    scale, zero = qparams(w, bits, True, full_range=True)
    q = quantize_codes(w, scale.unsqueeze(-1), zero.unsqueeze(-1), bits)
    assert torch.all(zero == (1 << (bits - 1)))
    for i in range(w.shape[0]):
        for j in range(w.shape[1]):
            want_scale, want_q = reference(w[i, j].tolist(), bits)
            assert float(scale[i, j]) == pytest.approx(want_scale, rel=1e-6), (i, j)
            assert q[i, j].tolist() == want_q, (i, j)
    # the larger side lands on code 0 exactly, positive-larger groups carry negative scales
    assert q[1, 0].min() == 0 and scale[1, 0] < 0 and scale[2, 0] > 0 and scale[3, 0] < 0
    assert float(scale[0, 0]) == 1.0


def test_full_range_uses_every_level_and_has_less_error_than_restricted() -> None:
    """On Gaussian weights, the finer step of the full range lowers the squared error of RTN
    (a restricted grid's step is 8/7 as large) and uses all 16 levels."""
    W = torch.randn(256, 512, generator=torch.Generator().manual_seed(1))
    full = quantize_rtn(W, None, make_scheme("rtn", group_size=64, symmetric=True, full_range=True))
    restricted = quantize_rtn(W, None, make_scheme("rtn", group_size=64, symmetric=True))
    err = lambda qw: float((qw.dequantize() - W).pow(2).sum())  # noqa: E731
    assert err(full) < 0.9 * err(restricted)
    assert torch.bincount(full.q.flatten().long(), minlength=16).min() > 0
    assert torch.bincount(restricted.q.flatten().long(), minlength=16)[0] == 0  # ±7 never reaches code 0
    assert 0.3 < float((full.scale < 0).float().mean()) < 0.7 and bool((restricted.scale > 0).all())


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_mse_observer_on_the_full_range_grid(scale_dtype: torch.dtype) -> None:
    """The MSE observer shrinks the signed range: at p = 1 (maxshrink 0 grid points) it is
    the min-max full range, and each chosen group's |error|^2.4 is at most min-max's."""
    w = groups(seed=2)
    base = qparams(w, 4, True, scale_dtype, full_range=True)
    scale, zero = mse_qparams(w, 4, True, scale_dtype, full_range=True)
    assert torch.equal(mse_qparams(w, 4, True, scale_dtype, full_range=True, maxshrink=0.01)[0], base[0])

    def err(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        s, z = s.unsqueeze(-1), z.unsqueeze(-1)
        return ((quantize_codes(w, s, z, 4) - z) * s - w).abs().pow(2.4).sum(-1)

    assert bool((err(scale, zero) <= err(*base)).all())
    assert bool((torch.sign(scale) == torch.sign(base[0])).all())  # a shrink keeps each group's side
    assert bool((scale.to(scale_dtype).float() == scale).all())


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
def test_autoround_starts_at_full_range_rtn_bit_for_bit(scale_dtype: str) -> None:
    scheme = make_scheme("autoround", group_size=32, symmetric=True, full_range=True, scale_dtype=scale_dtype)
    W = groups(seed=3).reshape(40, 64)
    got = quantize_rounding(W, Rounding.initial(W.shape, 32), scheme)
    want = quantize_rtn(W, None, scheme)
    assert torch.equal(got.q, want.q) and torch.equal(got.scale, want.scale)
    assert torch.equal(
        fake_quantize_rounding(Grouped.of(W, scheme), Rounding.initial(W.shape, 32), scheme), want.dequantize()
    )


def test_autoround_clip_factors_shrink_the_side_that_sets_the_scale() -> None:
    """β < 1 on a group whose positive side is the larger shrinks |scale| by β (negative
    scale kept); the straight-through gradient reaches β and not α there."""
    scheme = make_scheme("autoround", group_size=32, symmetric=True, full_range=True)
    W = groups(seed=4).reshape(40, 64)
    W[5, :32] = torch.linspace(-0.2, 0.8, 32)  # positive side larger
    p = Rounding.initial(W.shape, 32)
    with torch.no_grad():
        p.beta[5, 0] = 0.5
    qw = quantize_rounding(W, p, scheme)
    assert float(qw.scale[5, 0]) == pytest.approx(-0.8 * 0.5 / 8, rel=1e-6)
    fake_quantize_rounding(Grouped.of(W, scheme), p, scheme)[5, :32].sum().backward()
    assert p.beta.grad[5, 0] != 0 and p.alpha.grad[5, 0] == 0


def test_gptq_static_groups_take_the_full_range_scales_of_the_original_weights() -> None:
    gen = torch.Generator().manual_seed(5)
    W = torch.randn(48, 128, generator=gen)
    X = torch.randn(512, 128, generator=gen) @ torch.randn(128, 128, generator=gen) * 0.2
    scheme = make_scheme("gptq", group_size=32, symmetric=True, full_range=True, act_order=True)
    qw = quantize_gptq(W, X.T @ X, scheme)
    want, _ = qparams(W.reshape(48, 4, 32), 4, True, full_range=True)
    assert torch.equal(qw.scale, want) and qw.has_trivial_g_idx()
    # and GPTQ's error feedback lowers the output error against RTN on the same grid
    rtn = quantize_rtn(W, None, scheme)
    out_err = lambda qw: float(((qw.dequantize() - W) @ X.T).norm())  # noqa: E731
    assert out_err(qw) < out_err(rtn)


METHODS = {
    "rtn": ("--method", "rtn"),
    "gptq": ("--method", "gptq"),
    "awq": ("--method", "awq"),
    "awq+gptq": ("--method", "awq+gptq"),
    "autoround": ("--method", "autoround", "--iters", "4", "--batch", "2"),
}


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_writes_signed_scales_that_transformers_reads(
    tiny: dict[str, Path],  # noqa: F811
    tmp_path: Path,
    method: str,
) -> None:
    """compressed-tensors through plain transformers gives our dequantized model's logits
    (relative difference < 1e-4: the same float32 products)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ckpt"
    code, stdout, stderr = quantize(
        tiny, out, *METHODS[method], "--group-size", "32", "--sym", "--full-range", "--json"
    )
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["scheme"]["full_range"] is True and "full-range" in report["scheme_description"]
    ours, quantized = reference_model(tiny, out)
    negative = torch.cat([qw.scale.flatten() < 0 for qw in quantized.values()]).float().mean()
    assert 0.2 < float(negative) < 0.8, float(negative)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(3, 93, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = loaded(ids).logits, ours(ids).logits
    assert float((a - b).norm() / b.norm()) < 1e-4


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_awq_and_gptq_formats_carry_the_signed_scales(
    tiny: dict[str, Path],  # noqa: F811
    tmp_path: Path,
    fmt: str,
) -> None:
    """RTN written as `fmt` reads back to the codes and (negative) scales of the source
    weights quantized in memory with the fp16 scales the format stores: exact."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / fmt
    code, _, stderr = quantize(
        tiny, out, "--method", "rtn", "--group-size", "32", "--sym", "--full-range", "--format", fmt
    )
    assert code == 0, stderr
    read = read_checkpoint(out)[1]
    model = AutoModelForCausalLM.from_pretrained(tiny["model"], dtype=torch.float32)
    scheme = make_scheme("rtn", group_size=32, symmetric=True, full_range=True).for_storage("float16")
    assert len(read) == 14
    for name, back in read.items():
        want = quantize_rtn(model.get_submodule(name).weight.detach(), None, scheme)
        assert torch.equal(back.q, want.q) and torch.equal(back.zero_points(), want.zero_points()), name
        assert torch.equal(back.scale, want.scale) and bool((back.scale < 0).any()), name


def test_autoround_takes_the_full_range_grid_by_default_for_symmetric_groups_only(
    tiny: dict[str, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    """auto-round's own default: `--method autoround --sym` without the flag writes signed
    scales; `--no-full-range` keeps ±7, `--asym` is unaffected, and no other method changes
    its default."""
    assert make_scheme("autoround").full_range is True
    assert make_scheme("autoround", symmetric=False).full_range is False
    assert make_scheme("autoround", full_range=False).full_range is False
    assert not any(make_scheme(m).full_range for m in ("rtn", "gptq", "awq", "awq+gptq"))
    few = ("--method", "autoround", "--iters", "2", "--batch", "2", "--group-size", "32", "--json")
    for extra, full in ((("--sym",), True), (("--sym", "--no-full-range"), False), (("--asym",), False)):
        out = tmp_path / "-".join(extra)
        code, stdout, stderr = quantize(tiny, out, *few, *extra)
        assert code == 0, stderr
        assert json.loads(stdout)["scheme"]["full_range"] is full, extra
        scales = torch.cat([qw.scale.flatten() for qw in read_checkpoint(out)[1].values()])
        assert bool((scales < 0).any()) is full, extra


def test_full_range_refusals_exit_2_before_any_work(tiny: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    cases = [
        (["--method", "gptq", "--asym", "--full-range"], "--full-range is a grid of symmetric groups"),
        (["--scheme", "W8A8", "--full-range"], "--full-range does not go with int8 activations"),
        (["--method", "rtn", "--fp4", "nvfp4", "--full-range"], "--full-range"),
    ]
    for extra, needle in cases:
        code, _, stderr = quantize(tiny, tmp_path / "x", *extra)
        assert code == 2, (extra, stderr)
        assert needle in stderr and "Traceback" not in stderr and stderr.count("\n") <= 2, (extra, stderr)
        assert not (tmp_path / "x").exists()
