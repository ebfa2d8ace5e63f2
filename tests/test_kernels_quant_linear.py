"""Int4Linear / Fp8Linear / Fp4Linear: leading batch dims, bias, both backends, against nn.Linear
with the independently dequantized float64 weight."""

import pytest
import torch
from torch import nn

from infer_tool.kernels.quant_linear import Fp4Linear, Fp8Linear, Int4Linear, backend_name

K, N = 136, 72


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def int4_layer(*, asym, act_order, seed=0, group_size=32):
    """(Int4Linear, float64 nn.Linear with the same weights) in nn.Linear orientation."""
    g = torch.Generator().manual_seed(seed)
    G = -(-K // group_size)  # 136 = 4 x 32 + 8: a partial last group
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)  # (N, K)
    scale = torch.rand(N, G, generator=g) * 0.02 + 0.005  # (N, G)
    zero = torch.randint(0, 16, (N, G), generator=g, dtype=torch.uint8) if asym else None
    groups = torch.arange(K) // group_size
    g_idx = groups[torch.randperm(K, generator=g)].to(torch.int32) if act_order else None
    if act_order:
        groups = g_idx.long()
    bias = torch.randn(N, generator=g)
    zf = zero.double()[:, groups] if asym else 8.0
    w = (q.double() - zf) * scale.double()[:, groups]  # (N, K)
    dense = nn.Linear(K, N, dtype=torch.float64)
    with torch.no_grad():
        dense.weight.copy_(w)
        dense.bias.copy_(bias.double())
    return Int4Linear.from_unpacked(q, scale, zero, g_idx, group_size, bias), dense


@pytest.mark.parametrize("asym,act_order", [(False, False), (True, False), (True, True)])
def test_int4_linear_reference_path(monkeypatch, asym, act_order):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layer, dense = int4_layer(asym=asym, act_order=act_order)
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(1))
    out = layer(x)
    assert out.shape == (2, 3, N) and out.dtype == torch.float32
    assert rel_err(out, dense(x.double())) < 1e-5  # fp32 compute
    assert backend_name(x.device) == "torch-reference"


def test_int4_linear_interpreter_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    layer, dense = int4_layer(asym=True, act_order=True, seed=2)
    layer.half()
    x = torch.randn(4, 5, K, generator=torch.Generator().manual_seed(3)).half()
    assert rel_err(layer(x), dense(x.double())) < 2e-3  # fp16 weights/output
    assert backend_name("cpu") == "triton-interpreter"


def test_int4_linear_state_dict_round_trip():
    layer, _ = int4_layer(asym=True, act_order=False, seed=4)
    clone = Int4Linear(
        torch.zeros_like(layer.qweight),
        torch.zeros_like(layer.scales),
        torch.zeros_like(layer.zeros),
        None,
        torch.zeros(N),
        32,
        K,
        N,
    )
    clone.load_state_dict(layer.state_dict())
    x = torch.randn(3, K)
    assert torch.equal(clone(x), layer(x))


def fp8_layer(mode, *, static, block, seed=5):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    if block:
        bs = (32, 64)  # not the usual 128 x 128: exercises partial blocks on both dims
        scale = torch.rand(-(-N // 32), -(-K // 64), generator=g) * 1e-3 + 1e-4
        w_fp8 = (torch.randn(N, K, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    else:
        bs = None
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        w_fp8 = (w / scale).to(torch.float8_e4m3fn)
    bias = torch.randn(N, generator=g)
    input_scale = torch.tensor([4.0 / 448]) if static else None
    return Fp8Linear(w_fp8, scale, input_scale, bias, bs, mode), w_fp8, scale, bs, bias, input_scale


def dequant_blocks(w_fp8, scale, bs):
    if bs is None:
        return w_fp8.double() * scale.double()
    s = scale.double().repeat_interleave(bs[0], 0)[: w_fp8.shape[0]].repeat_interleave(bs[1], 1)
    return w_fp8.double() * s[:, : w_fp8.shape[1]]


@pytest.mark.parametrize("interpret", [False, True], ids=["reference", "interpreter"])
@pytest.mark.parametrize(
    "mode,static,block", [("w8a16", False, True), ("w8a8", False, False), ("w8a8", True, False), ("w8a8", False, True)]
)
def test_fp8_linear(monkeypatch, interpret, mode, static, block):
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layer, w_fp8, scale, bs, bias, input_scale = fp8_layer(mode, static=static, block=block)
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(6))
    w = dequant_blocks(w_fp8, scale, bs)  # (N, K) float64, written here independently
    xd = x.double().reshape(-1, K)
    if mode == "w8a8":  # activations through torch's own e4m3 cast
        a = (xd.abs().amax(dim=1, keepdim=True) / 448) if input_scale is None else input_scale.double()
        xd = (xd / a).clamp(-448, 448).float().to(torch.float8_e4m3fn).double() * a
    ref = (xd @ w.T + bias.double()).reshape(2, 3, N)
    out = layer(x)
    assert out.shape == (2, 3, N)
    assert rel_err(out, ref) < 1e-5


def test_fp8_linear_survives_model_dtype_casts(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layer, *_ = fp8_layer("w8a8", static=True, block=True)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(7)).half().float()  # fp16-exact
    before = layer(x)
    layer.half()  # what model.half() / model.to(torch.float16) do to every submodule
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale.dtype == torch.float32 and layer.input_scale.dtype == torch.float32
    assert layer.bias.dtype == torch.float16
    after = layer(x.half())
    assert after.dtype == torch.float16
    # Same quantized activations (x is fp16-exact); only the fp16 bias and output differ.
    assert rel_err(after, before.double()) < 2e-3


def test_backend_names():
    assert backend_name(torch.device("cuda")) == "triton"
    assert backend_name("cuda:0") == "triton"


def fp4_layer(fmt, *, w4a4=False, seed=8):
    """(Fp4Linear, its float64 weight written here from the codes and scales, the input scale)."""
    from infer_tool.kernels.fp4_layout import pack_fp4

    g = torch.Generator().manual_seed(seed)
    k, group = 128, {"nvfp4": 16, "mxfp4": 32}[fmt]
    codes = torch.randint(0, 16, (N, k), generator=g, dtype=torch.uint8)
    if fmt == "nvfp4":
        scale = (torch.rand(N, k // group, generator=g) * 400 + 1).to(torch.float8_e4m3fn)
        gs = torch.tensor([2000.0])
        eff = scale.double() / 2000.0
    else:
        scale = torch.randint(118, 130, (N, k // group), generator=g, dtype=torch.uint8)
        gs = None
        eff = 2.0 ** (scale.double() - 127)
    mag = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)[(codes & 7).long()]
    w = torch.where(codes >= 8, -mag, mag) * eff.repeat_interleave(group, 1)
    igs = torch.tensor([300.0]) if w4a4 and fmt == "nvfp4" else None
    bias = torch.randn(N, generator=g)
    return Fp4Linear(pack_fp4(codes), scale, gs, bias, w4a4=w4a4, input_global_scale=igs), w, bias, igs


@pytest.mark.parametrize("interpret", [False, True], ids=["reference", "interpreter"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("w4a4", [False, True], ids=["a16", "w4a4"])
def test_fp4_linear(monkeypatch, interpret, fmt, w4a4):
    """y = a(x) @ wᵀ + b against the float64 weight; a(x) is the W4A4 rule of kernels/fp4_act.py
    (tested bit for bit against vLLM's in tests/test_fp4.py) or the identity."""
    from infer_tool.packers import fp4

    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layer, w, bias, igs = fp4_layer(fmt, w4a4=w4a4)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(9))
    a = x
    if w4a4:
        a = fp4.nvfp4_fake_quantize_input(x, igs) if fmt == "nvfp4" else fp4.mxfp4_fake_quantize_input(x)
        assert not torch.equal(a, x)
    ref = (a.double().reshape(-1, 128) @ w.T + bias.double()).reshape(2, 3, N)
    assert layer(x).shape == (2, 3, N) and rel_err(layer(x), ref) < 1e-5


def test_fp4_linear_survives_model_dtype_casts_and_refuses_a_wrong_input_scale(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layer, *_ = fp4_layer("nvfp4", w4a4=True)
    layer.half()
    assert layer.w_scale.dtype == torch.float8_e4m3fn and layer.w_packed.dtype == torch.uint8
    assert layer.global_scale.dtype == torch.float32 and layer.input_global_scale.dtype == torch.float32
    assert layer.bias.dtype == torch.float16
    assert layer(torch.randn(3, 128).half()).dtype == torch.float16
    from infer_tool.kernels.fp4_layout import pack_fp4

    with pytest.raises(ValueError, match="NVFP4 W4A4 needs the input_global_scale"):
        Fp4Linear(
            pack_fp4(torch.zeros(4, 32, dtype=torch.uint8)),
            torch.ones(4, 2).to(torch.float8_e4m3fn),
            torch.tensor([1.0]),
            w4a4=True,
        )
