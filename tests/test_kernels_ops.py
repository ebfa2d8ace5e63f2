"""The quantized linears as `torch.library` custom ops (`kernels/ops.py`): schemas and fake
implementations pass `torch.library.opcheck`, a module of them compiles with
`torch.compile(fullgraph=True)` and gives the eager result bit for bit (CPU: the torch
reference inside the op), and Int4Linear's kernel copy follows its weight."""

import pytest
import torch
from torch import nn

from infer_tool.kernels import ops
from infer_tool.kernels.layout import pack_int4_k
from infer_tool.kernels.quant_linear import Fp8Linear, Int4Linear
from infer_tool.kernels.w4_layout import prepare

K, N = 256, 48


def int4_operands(seed=0, *, asym=True, act_order=True, group=64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (K, N), generator=g, dtype=torch.uint8)
    G = K // group
    s = torch.rand(G, N, generator=g) * 0.02 + 0.005
    z = torch.randint(0, 16, (G, N), generator=g, dtype=torch.uint8) if asym else None
    g_idx = (torch.arange(K) // group)[torch.randperm(K, generator=g)].to(torch.int32) if act_order else None
    return pack_int4_k(q), s, z, g_idx, group


@pytest.mark.parametrize("interpret", [False, True], ids=["reference", "interpreter"])
def test_w4a16_op_passes_opcheck(monkeypatch, interpret):
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    qw, s, z, g_idx, group = int4_operands()
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(1))
    w = prepare(qw, s, z, g_idx, group, K)
    for args in ((x, qw, s, z, g_idx, group), (x, qw, s, z, g_idx, group, w.qweight, w.g_idx, w.perm)):
        torch.library.opcheck(torch.ops.infer_tool.w4a16_mm.default, args)


def test_fp8_and_fp4_ops_pass_opcheck(monkeypatch):
    from infer_tool.kernels.fp4_layout import pack_fp4

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, K, generator=g)
    w = (torch.randn(N, K, generator=g) * 0.1).to(torch.float8_e4m3fn)
    bits = w.view(torch.uint8)
    torch.library.opcheck(torch.ops.infer_tool.fp8_mm.default, (x, bits, torch.rand(N, 1) + 0.1, "w8a8", 0, 0, None))
    blocks = torch.rand(1, 2) + 0.1
    torch.library.opcheck(torch.ops.infer_tool.fp8_mm.default, (x, bits, blocks, "w8a16", 128, 128, None))
    packed = pack_fp4(torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8))
    e8m0 = torch.randint(120, 128, (N, K // 32), generator=g, dtype=torch.uint8)
    torch.library.opcheck(torch.ops.infer_tool.fp4_mm.default, (x, packed, e8m0, False, None))
    e4m3 = (torch.rand(N, K // 16, generator=g) * 400 + 1).to(torch.float8_e4m3fn).view(torch.uint8)
    torch.library.opcheck(torch.ops.infer_tool.fp4_mm.default, (x, packed, e4m3, True, torch.tensor([2000.0])))


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        qw, s, z, g_idx, group = int4_operands(3)
        self.a = Int4Linear(qw, s, z, g_idx, torch.randn(N), group, K, N)
        w = (torch.randn(K, N) * 0.1).to(torch.float8_e4m3fn)
        self.b = Fp8Linear(w, torch.rand(K, 1) + 0.05, mode="w8a8")

    def forward(self, x):
        return self.b(torch.nn.functional.silu(self.a(x)))


def test_module_compiles_fullgraph_and_matches_eager(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch._dynamo.reset()
    model = TwoLinears()
    x = torch.randn(2, 5, K, generator=torch.Generator().manual_seed(4))
    eager = model(x)
    # aot_eager traces through the fake implementations (AOTAutograd) as inductor does;
    # inductor itself passes too but takes about a minute of C++ compiling on a CI core.
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    assert out.shape == (2, 5, K)
    assert torch.equal(out, eager)
    torch._dynamo.reset()


def test_int4_linear_prepares_once_and_follows_a_loaded_state_dict(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    qw, s, z, g_idx, group = int4_operands(5)
    layer = Int4Linear(qw, s, z, g_idx, None, group, K, N)
    assert layer._kqweight is None  # CPU: nothing prepared until a kernel call
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(6))
    first = layer(x)
    kq = layer._kqweight
    assert kq is not None and "_kqweight" not in layer.state_dict()
    layer(x)
    assert layer._kqweight is kq  # prepared once
    other = Int4Linear(*int4_operands(7)[:4], None, group, K, N)
    layer.load_state_dict(other.state_dict())
    assert not torch.equal(layer._kqweight, kq)
    assert torch.equal(layer(x), other(x)) and not torch.equal(layer(x), first)


def test_the_op_is_what_the_module_calls(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []
    real = ops.w4a16_mm
    monkeypatch.setattr(ops, "w4a16_mm", lambda *a: (calls.append(len(a)), real(*a))[1])
    qw, s, z, g_idx, group = int4_operands(8)
    Int4Linear(qw, s, z, g_idx, None, group, K, N)(torch.randn(2, K))
    assert calls == [9]
