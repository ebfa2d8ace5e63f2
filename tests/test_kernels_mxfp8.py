"""MXFP8 weights-only (MXFP8A16) through `Mxfp8Linear`: the FP8 Triton kernel with one float32
scale per (1, 32) block, which is exactly the E8M0 scale, under TRITON_INTERPRET=1 against a
float64 reference built from the checkpoint's bytes (values and E8M0 exponents decoded by
definition). Tolerance: relative Frobenius error 1e-5 for fp32 activations (fp32 accumulation),
2e-3 for fp16 (fp16 output); a scale applied to the wrong group costs at least a factor of 2 on
that group's products, far above either."""

import pytest
import torch

from infer_tool.formats.mxfp8.linear import Mxfp8Linear
from infer_tool.formats.mxfp8.solve import quantize_rtn
from infer_tool.kernels import backend

TOL = {torch.float16: 2e-3, torch.float32: 1e-5}
N, K = 72, 224  # 7 groups of 32; neither a multiple of the kernel's tiles


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(backend, "empty_output", poisoned)


def reference(x: torch.Tensor, values: torch.Tensor, u: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """float64 x @ Wᵀ + b with W[n, k] = value[n, k] * 2^(u[n, k // 32] - 127), by definition."""
    scale = torch.pow(torch.tensor(2.0, dtype=torch.float64), u.double() - 127).repeat_interleave(32, dim=1)
    return x.double() @ (values.double() * scale).T + bias.double()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("M", [1, 5, 33])
def test_mxfp8_linear_matches_float64(M, dtype):
    g = torch.Generator().manual_seed(M)
    W = torch.randn(N, K, generator=g) * 2.0 ** torch.randint(-6, 3, (N, K // 32), generator=g).repeat_interleave(32, 1)
    w = quantize_rtn(W)
    bias = torch.randn(N, generator=g).to(dtype)
    layer = Mxfp8Linear(w.values, w.scale_exp, bias)
    x = torch.randn(M, K, generator=g).to(dtype)
    out = layer(x)
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    ref = reference(x, w.values, w.scale_exp, bias)
    err = float((out.double() - ref).norm() / ref.norm())
    assert err <= TOL[dtype], err


def test_mxfp8_linear_keeps_its_bytes_through_moves():
    w = quantize_rtn(torch.randn(8, 64))
    layer = Mxfp8Linear(w.values, w.scale_exp).to(torch.bfloat16)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.uint8
    assert torch.equal(layer.weight.view(torch.uint8), w.values.view(torch.uint8))
