"""RTN, GPTQ and AWQ on tiny random layers, against references written here.

Output error is ‖X·(Ŵ − W)ᵀ‖² / ‖X·Wᵀ‖² on correlated inputs X (seeded); margins are stated
next to each assertion."""

import pytest
import torch

from infer_tool.common.errors import BadInput
from infer_tool.packers.awq import (
    apply_awq_clip,
    awq_search_clip,
    awq_search_scale,
)
from infer_tool.packers.gptq import quantize_gptq
from infer_tool.packers.rtn import fake_quantize, quantize_rtn
from infer_tool.schemes.base import check_group_size
from infer_tool.schemes.integer import AWQScheme, GPTQScheme, RTNScheme
from infer_tool.schemes.registry import make_scheme


def _representable(n, k, g, bits, symmetric, seed=0):
    """W = (q - z)·s with power-of-two scales (exact in fp32); every group spans its range."""
    gen = torch.Generator().manual_seed(seed)
    maxq = (1 << bits) - 1
    G = k // g
    s = 2.0 ** torch.randint(-6, 0, (n, G), generator=gen).float()
    if symmetric:
        z = torch.full((n, G), 1 << (bits - 1))
        lo, hi = 1, maxq  # q - z in [-(2^(b-1)-1), 2^(b-1)-1]
    else:
        z = torch.randint(1, maxq, (n, G), generator=gen)
        lo, hi = 0, maxq
    q = torch.randint(lo, hi + 1, (n, k), generator=gen)
    q[:, 0::g] = hi  # each group holds the extreme codes, so min/max recover s and z
    q[:, 1::g] = lo
    gi = torch.arange(k) // g
    W = (q - z[:, gi]).float() * s[:, gi]
    return W, q, s, z


def _correlated_inputs(t, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(k, k, generator=gen) / k**0.5
    X = torch.randn(t, k, generator=gen) @ A + 0.1 * torch.randn(t, k, generator=gen)
    return X * torch.exp(torch.randn(k, generator=gen))  # per-channel magnitudes vary (outliers)


def _out_err(X, W, W_hat):
    return float(((X @ (W_hat - W).T) ** 2).sum() / ((X @ W.T) ** 2).sum())


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits,g", [(4, 16), (3, 32), (8, 64)])
def test_rtn_exact_on_representable_weights(symmetric, bits, g):
    W, q, s, z = _representable(8, 128, g, bits, symmetric)
    qw = quantize_rtn(W, None, RTNScheme(bits=bits, group_size=g, symmetric=symmetric))
    qw.validate()
    assert torch.equal(qw.q.long(), q)
    assert torch.equal(qw.scale, s)
    assert torch.equal(qw.dequantize(), W)


def test_rtn_with_g_idx_groups_non_contiguous_columns():
    W, *_ = _representable(8, 64, 16, 4, False, seed=1)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    Wp = W[:, perm]  # column perm[k] of W is column k of Wp: its group is perm[k] // 16
    g_idx = (perm // 16).to(torch.int32)
    qw = quantize_rtn(Wp, None, RTNScheme(group_size=16, symmetric=False), g_idx=g_idx)
    assert torch.equal(qw.dequantize(), Wp)
    assert not qw.has_trivial_g_idx()


def test_rtn_error_bound():
    """|w - ŵ| ≤ scale/2 inside the range (asymmetric never clips)."""
    W = torch.randn(16, 128, generator=torch.Generator().manual_seed(0))
    qw = quantize_rtn(W, None, RTNScheme(group_size=32, symmetric=False))
    s = qw.scale[:, qw.group_index()]
    assert bool(((qw.dequantize() - W).abs() <= s / 2 + 1e-6).all())


# Dynamic act-order groups regroup columns in activation order, so weights representable
# on the original groups are not representable on those: exactness is for these two.
@pytest.mark.parametrize("act_order,static", [(False, True), (True, True)])
def test_gptq_exact_on_representable_weights(act_order, static):
    W, q, s, z = _representable(16, 128, 32, 4, False, seed=2)
    X = _correlated_inputs(512, 128)
    H = 2 * X.T @ X / X.shape[0]
    qw = quantize_gptq(W, H, GPTQScheme(group_size=32, symmetric=False, act_order=act_order, static_groups=static))
    assert qw.info["fallback"] is None
    assert torch.equal(qw.dequantize(), W)


def _gptq_reference(W, H, g, bits, damp):
    """GPTQ from its §3 update rules without Cholesky or blocks (OBQ-style inverse updates).

    Quantize column i with its group's params (computed on the current weights when the
    group starts), push err/[H⁻¹]_ii · H⁻¹[i, i:] onto the remaining columns, then remove
    row/column i from H⁻¹ by Gaussian elimination (eq. 3)."""
    W = W.double().clone()
    H = H.double().clone()
    K = W.shape[1]
    H += damp * torch.diag(H).mean() * torch.eye(K, dtype=torch.float64)
    Hinv = torch.linalg.inv(H)
    maxq = (1 << bits) - 1
    Q = torch.zeros_like(W)
    for i in range(K):
        if i % g == 0:
            blk = W[:, i : i + g]
            lo = blk.min(1).values.clamp(max=0)
            hi = blk.max(1).values.clamp(min=0)
            scale = (hi - lo) / maxq
            zero = torch.round(-lo / scale)
        w = W[:, i]
        Q[:, i] = (torch.clamp(torch.round(w / scale) + zero, 0, maxq) - zero) * scale
        err = (w - Q[:, i]) / Hinv[i, i]
        W[:, i:] -= err[:, None] * Hinv[i, i:][None, :]
        Hinv = Hinv - Hinv[:, i : i + 1] @ Hinv[i : i + 1, :] / Hinv[i, i]
    return Q.float()


def test_gptq_matches_reference_update_rules():
    """The blocked Cholesky implementation equals the textbook updates (same codes, up to
    rare rounding ties: ≥ 99% of codes identical, output error within 2%)."""
    gen = torch.Generator().manual_seed(3)
    W = torch.randn(32, 96, generator=gen)
    X = _correlated_inputs(400, 96, seed=3)
    H = 2 * X.T @ X / X.shape[0]
    qw = quantize_gptq(W, H, GPTQScheme(group_size=32, symmetric=False, block_size=32, act_order=False))
    ref = _gptq_reference(W, H, 32, 4, 0.01)
    ours = qw.dequantize()
    same = (ours - ref).abs() <= 1e-4 * qw.scale[:, qw.group_index()]
    assert same.float().mean() >= 0.99
    assert abs(_out_err(X, W, ours) - _out_err(X, W, ref)) <= 0.02 * _out_err(X, W, ref)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_correlated_inputs(symmetric, act_order):
    """Margin: GPTQ's output error is at most 0.75× RTN's (observed about 0.35–0.55×)."""
    gen = torch.Generator().manual_seed(4)
    W = torch.randn(64, 256, generator=gen)
    X = _correlated_inputs(1024, 256, seed=4)
    H = 2 * X.T @ X / X.shape[0]
    scheme = GPTQScheme(group_size=64, symmetric=symmetric, act_order=act_order)
    e_gptq = _out_err(X, W, quantize_gptq(W, H, scheme).dequantize())
    e_rtn = _out_err(X, W, quantize_rtn(W, None, scheme).dequantize())
    assert e_gptq < 0.75 * e_rtn


def test_gptq_static_groups_consistent_with_g_idx():
    """Static act-order: scales/zeros are the RTN ones of the ORIGINAL column groups, g_idx
    is k // g (stored as None), and the codes read through it give the low-error weights."""
    gen = torch.Generator().manual_seed(5)
    W = torch.randn(32, 128, generator=gen)
    X = _correlated_inputs(512, 128, seed=5)
    H = 2 * X.T @ X / X.shape[0]
    scheme = GPTQScheme(group_size=32, symmetric=False, act_order=True, static_groups=True)
    qw = quantize_gptq(W, H, scheme)
    rtn = quantize_rtn(W, None, scheme)
    assert qw.g_idx is None and qw.has_trivial_g_idx()
    assert torch.equal(qw.scale, rtn.scale) and torch.equal(qw.zero, rtn.zero)
    assert _out_err(X, W, qw.dequantize()) < 0.75 * _out_err(X, W, rtn.dequantize())
    # dynamic groups: g_idx assigns exactly g columns to each group, and is what makes it work
    dyn = quantize_gptq(W, H, GPTQScheme(group_size=32, symmetric=False, act_order=True, static_groups=False))
    assert dyn.g_idx is not None and not dyn.has_trivial_g_idx()
    assert torch.equal(torch.bincount(dyn.g_idx.long()), torch.full((4,), 32))
    assert _out_err(X, W, dyn.dequantize()) < 0.75 * _out_err(X, W, rtn.dequantize())
    dyn.g_idx = None  # read with the wrong (trivial) g_idx the weights are wrong
    assert _out_err(X, W, dyn.dequantize()) > 2 * _out_err(X, W, rtn.dequantize())


def test_gptq_dead_columns():
    gen = torch.Generator().manual_seed(6)
    W = torch.randn(16, 64, generator=gen)
    X = _correlated_inputs(256, 64, seed=6)
    X[:, 5] = 0
    H = 2 * X.T @ X / X.shape[0]
    qw = quantize_gptq(W, H, GPTQScheme(group_size=32))
    assert qw.info["dead_columns"] == 1
    assert bool((qw.dequantize()[:, 5] == 0).all())


def test_gptq_raises_damping_then_succeeds():
    """diag(H) = [1, ..., 1, -0.05]: damp 0.01·mean fails, 0.1·mean succeeds."""
    H = torch.eye(64)
    H[-1, -1] = -0.05
    W = torch.randn(8, 64, generator=torch.Generator().manual_seed(7))
    qw = quantize_gptq(W, H, GPTQScheme(group_size=32))
    assert qw.info["fallback"] is None
    assert qw.info["attempts"] == 2
    assert qw.info["damp"] == pytest.approx(0.1)


@pytest.mark.parametrize("bad", ["negative", "nan"])
def test_gptq_falls_back_to_rtn(bad):
    H = -torch.eye(64) if bad == "negative" else torch.full((64, 64), float("nan"))
    W = torch.randn(8, 64, generator=torch.Generator().manual_seed(8))
    scheme = GPTQScheme(group_size=32)
    qw = quantize_gptq(W, H, scheme)
    assert qw.info["fallback"] == "rtn" and qw.info["reason"]
    assert torch.equal(qw.q, quantize_rtn(W, None, scheme).q)
    if bad == "negative":
        assert qw.info["attempts"] == scheme.damp_retries + 1


def test_awq_beats_rtn_on_salient_channels():
    """Scale search + clip search on one linear: output error at most 0.8× RTN's (observed ~0.5×)."""
    gen = torch.Generator().manual_seed(9)
    W = torch.randn(64, 256, generator=gen)
    X = _correlated_inputs(1024, 256, seed=9)
    scheme = AWQScheme(group_size=64)
    ref = X @ W.T
    found = awq_search_scale(X.abs().mean(0), [W], lambda eff: X @ eff[0].T, ref, scheme)
    assert len(found.losses) == scheme.grid
    assert found.best_loss < found.rtn_loss
    Ws, Xs = W * found.scales, X / found.scales
    Wc = apply_awq_clip(Ws, awq_search_clip(Ws, Xs, scheme))
    e_awq = _out_err(Xs, Ws, quantize_rtn(Wc, None, scheme).dequantize())  # X/s·Q(W·s) vs X·W
    e_rtn = _out_err(X, W, fake_quantize(W, 4, 64, False))
    assert e_awq < 0.8 * e_rtn
    # the reported RTN loss is the plain RTN block-output MSE
    assert found.rtn_loss == pytest.approx(float(((X @ fake_quantize(W, 4, 64, False).T - ref) ** 2).mean()), rel=1e-5)


def test_awq_gram_loss_equals_running_the_linear():
    """The XᵀX form of a single linear's output MSE picks the same ratio with the same losses
    (fp32 tolerance 1e-4 relative) as running X·W_effᵀ, bias included (it cancels)."""
    gen = torch.Generator().manual_seed(13)
    W = torch.randn(48, 128, generator=gen)
    b = torch.randn(48, generator=gen)
    X = _correlated_inputs(2048, 128, seed=13)
    scheme = AWQScheme(group_size=32, search="full")  # every grid point's loss compared
    direct = awq_search_scale(X.abs().mean(0), [W], lambda eff: X @ eff[0].T + b, X @ W.T + b, scheme)
    fast = awq_search_scale(X.abs().mean(0), [W], None, None, scheme, gram=(X.T @ X, X.shape[0]))
    assert fast.ratio == direct.ratio and torch.equal(fast.scales, direct.scales)
    assert fast.rtn_loss == pytest.approx(direct.rtn_loss, rel=1e-4)
    assert fast.losses == pytest.approx(direct.losses, rel=1e-4)


def test_awq_clip_never_worse_per_group():
    """The clip search includes shrink 0 (no clipping), so each group's error cannot grow."""
    gen = torch.Generator().manual_seed(10)
    W = torch.randn(16, 64, generator=gen)
    X = _correlated_inputs(256, 64, seed=10)
    scheme = AWQScheme(group_size=32)
    t = awq_search_clip(W, X, scheme)
    assert t.shape == (16, 2)
    assert bool((t <= W.abs().reshape(16, 2, 32).amax(-1) + 1e-6).all())
    Wc = apply_awq_clip(W, t)

    def group_err(Wq):
        Xg, Wg, Wqg = X.reshape(-1, 2, 32), W.reshape(16, 2, 32), Wq.reshape(16, 2, 32)
        return ((torch.einsum("tgk,ngk->ntg", Xg, Wqg - Wg)) ** 2).mean(1)

    assert bool(
        (group_err(fake_quantize(Wc, 4, 32, False)) <= group_err(fake_quantize(W, 4, 32, False)) * (1 + 1e-5)).all()
    )


class _OnePlusNorm(torch.nn.Module):
    """Gemma-style norm: layer_norm(x) · (1 + weight)."""

    def __init__(self, k):
        super().__init__()
        self.weight = torch.nn.Parameter(0.1 * torch.randn(k))

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, x.shape[-1:]) * (1 + self.weight)


@pytest.mark.parametrize("prev_kind", ["layernorm", "one_plus_norm", "linear"])
def test_fold_scales_preserves_function(prev_kind):
    """Folding 1/s into the previous module and s into the balanced linears keeps the output."""
    from infer_tool.calib.architectures import Architecture, AWQMapping
    from infer_tool.calib.quantizers.awq import fold_scales

    torch.manual_seed(11)
    s = torch.rand(32) + 0.5
    x = torch.randn(10, 32)
    if prev_kind == "layernorm":
        prev, offset = torch.nn.LayerNorm(32), 0.0
        torch.nn.init.normal_(prev.weight)
        torch.nn.init.normal_(prev.bias)
    elif prev_kind == "one_plus_norm":
        prev, offset = _OnePlusNorm(32), 1.0
    else:
        prev, offset = torch.nn.Linear(32, 32), 0.0
    fcs = [torch.nn.Linear(32, 16), torch.nn.Linear(32, 8)]
    with torch.no_grad():
        before = [fc(prev(x)) for fc in fcs]
        fold_scales(prev, fcs, s, AWQMapping("prev", ("fc",), "fc"), Architecture("", (), (), norm_offset=offset))
        after = [fc(prev(x)) for fc in fcs]
    for a, b in zip(after, before):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_group_size_check_lists_layers_and_working_sizes():
    shapes = {"a.q_proj": (64, 576), "a.down_proj": (576, 1536), "b.o_proj": (64, 96)}
    with pytest.raises(BadInput) as e:
        check_group_size(shapes, 128)
    msg = str(e.value)
    assert "a.q_proj (K=576)" in msg and "b.o_proj (K=96)" in msg and "a.down_proj" not in msg
    assert "16, 32, -1" in msg
    check_group_size(shapes, 32)


def test_make_scheme_defaults_and_refusals():
    assert make_scheme("gptq", damp=None).damp == GPTQScheme().damp
    assert make_scheme("awq", group_size=64).symmetric is False
    with pytest.raises(BadInput):
        make_scheme("nope")
    with pytest.raises(BadInput):
        make_scheme("rtn", damp=0.1)
    with pytest.raises(BadInput):
        make_scheme("rtn", bits=9)


def test_awq_block_search_then_fold_beats_rtn():
    from infer_tool.calib.architectures import Architecture, AWQMapping
    from infer_tool.calib.quantizers.awq import fold_scales

    """A norm feeding two balanced linears: search s on the block output, fold 1/s into the
    norm and s into the linears, quantize; block output error at most 0.8× RTN's."""
    torch.manual_seed(12)
    K = 128
    norm = torch.nn.LayerNorm(K)
    with torch.no_grad():
        norm.weight.copy_(torch.exp(torch.randn(K)))  # salient channels come from the norm
    fcs = [torch.nn.Linear(K, 64, bias=False), torch.nn.Linear(K, 32, bias=False)]
    x = _correlated_inputs(512, K, seed=12)

    def block(weights):
        h = norm(x)
        return torch.cat([h @ w.T for w in weights], dim=-1)

    scheme = AWQScheme(group_size=32, clip=False)
    originals = [fc.weight.detach().clone() for fc in fcs]
    with torch.no_grad():
        ref = block(originals)
        found = awq_search_scale(norm(x).abs().mean(0), originals, block, ref, scheme)
        fold_scales(norm, fcs, found.scales, AWQMapping("norm", ("fc",), "fc"), Architecture("", (), ()))
        e_awq = float(((block([fake_quantize(fc.weight, 4, 32, False) for fc in fcs]) - ref) ** 2).mean())
    e_rtn = found.rtn_loss
    assert found.ratio is not None and e_awq < 0.8 * e_rtn
    assert e_awq == pytest.approx(found.best_loss, rel=1e-3)  # folding reproduces the searched loss


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("sym", [True, False])
def test_scales_are_solved_in_the_stored_dtype(dtype: str, sym: bool) -> None:
    """Every solver's scales are values of the checkpoint's scale dtype, and the codes are
    RTN against those rounded scales (not against fp32 ones rounded afterwards)."""
    gen = torch.Generator().manual_seed(14)
    W = torch.randn(32, 128, generator=gen) * 0.02
    X = _correlated_inputs(512, 128, seed=14)
    td = getattr(torch, dtype)
    for scheme, qw in (
        (RTNScheme(group_size=32, symmetric=sym, scale_dtype=dtype), None),
        (GPTQScheme(group_size=32, symmetric=sym, scale_dtype=dtype), None),
        (GPTQScheme(group_size=32, symmetric=sym, act_order=True, scale_dtype=dtype), None),
    ):
        qw = quantize_gptq(W, X.T @ X, scheme) if isinstance(scheme, GPTQScheme) else quantize_rtn(W, None, scheme)
        assert torch.equal(qw.scale.to(td).float(), qw.scale), scheme
    rtn = quantize_rtn(W, None, RTNScheme(group_size=32, symmetric=sym, scale_dtype=dtype))
    s = rtn.scale.repeat_interleave(32, dim=1)
    z = (torch.full_like(rtn.scale, 8) if sym else rtn.zero.float()).repeat_interleave(32, dim=1)
    assert torch.equal(rtn.q.float(), torch.clamp(torch.round(W / s) + z, 0, 15))
    assert torch.equal(fake_quantize(W, 4, 32, sym, td), rtn.dequantize())
    with pytest.raises(BadInput, match="int8"):
        RTNScheme(scale_dtype="int8")


@pytest.mark.parametrize(
    "kind",
    ["int4 sym static", "int4 asym dynamic", "int4 asym no act-order", "int8 channel", "nvfp4", "mxfp4"],
)
def test_gptq_stacked_parts_give_each_linear_its_own_bits(kind: str) -> None:
    """Linears sharing H (q/k/v, gate/up) solved as one stack with `parts` get exactly the
    codes, scales and loss of their own solves: GPTQ's updates are row-wise given H, and each
    part's block update is its own product."""
    from infer_tool.packers.fp4_solve import fp4_global_scale, quantize_fp4_gptq
    from infer_tool.packers.gptq import part_info
    from infer_tool.schemes.fp4 import Fp4GPTQScheme

    g = torch.Generator().manual_seed(3)
    K = 128
    X = torch.randn(512, K, generator=g) @ torch.randn(K, K, generator=g) * 0.3
    H = 2 * X.T @ X / 512
    Ws = [torch.randn(n, K, generator=g) * 0.05 for n in (40, 8, 24)]
    sizes = [int(w.shape[0]) for w in Ws]
    if kind in ("nvfp4", "mxfp4"):
        scheme = Fp4GPTQScheme(fp4=kind, act_order=True, block_size=32)
        gs = [fp4_global_scale([w], scheme) for w in Ws]  # each linear its own: each row keeps its linear's
        rows = None if gs[0] is None else torch.cat([s.expand(len(w)) for s, w in zip(gs, Ws)]).reshape(-1, 1)
        alone = [quantize_fp4_gptq(w, H, scheme, global_scale=s) for w, s in zip(Ws, gs)]
        stack = quantize_fp4_gptq(torch.cat(Ws), H, scheme, global_scale=rows, parts=sizes)
        tensors = lambda w: (w.codes, w.w_scale)  # noqa: E731
    else:
        scheme = {
            "int4 sym static": GPTQScheme(group_size=32, act_order=True, static_groups=True, block_size=32),
            "int4 asym dynamic": GPTQScheme(group_size=32, symmetric=False, act_order=True, block_size=32),
            "int4 asym no act-order": GPTQScheme(group_size=32, symmetric=False, act_order=False, block_size=32),
            "int8 channel": GPTQScheme(bits=8, group_size=-1, act_order=False, block_size=32),
        }[kind]
        alone = [quantize_gptq(w, H, scheme) for w in Ws]
        stack = quantize_gptq(torch.cat(Ws), H, scheme, parts=sizes)
        tensors = lambda w: (w.q, w.scale, w.zero, w.g_idx)  # noqa: E731
    for i, a in enumerate(alone):
        for x, y in zip(tensors(a), tensors(stack)):
            if x is None:
                assert y is None
                continue
            part = y if y.dim() == 1 else y[sum(sizes[:i]) : sum(sizes[: i + 1])]  # g_idx: one for all rows
            assert torch.equal(x, part), (kind, i)
        assert part_info(stack.info, i) == a.info  # the loss to the bit, damp, attempts, dead columns
    assert stack.info["loss"] == pytest.approx(sum(a.info["loss"] for a in alone), rel=1e-6)
    assert stack.info["loss"] > 0


def _mse_reference(w: torch.Tensor, bits: int, symmetric: bool) -> tuple[list[float], list[float]]:
    """Brute force of llm-compressor's MSE grid, one group at a time in float64: every
    shrink p = 1 - i/100 (i < 20) of [min(w, 0), max(w, 0)], its scale by this module's
    conventions (sym: absmax / (2^(b-1) - 1), zero 2^(b-1); asym: range / (2^b - 1), zero
    rounded), error Σ |qdq - w|^2.4. Returns (the least error, the first scale reaching it)
    per group."""
    maxq = (1 << bits) - 1
    best_err, best_scale = [], []
    for row in w.double().reshape(-1, w.shape[-1]):
        lo, hi = min(float(row.min()), 0.0), max(float(row.max()), 0.0)
        errs, scales = [], []
        for i in range(20):
            p = 1 - i / 100
            if symmetric:
                s, z = max(-lo * p, hi * p) / ((1 << (bits - 1)) - 1), float(1 << (bits - 1))
            else:
                s = (hi * p - lo * p) / maxq
                z = min(max(round(-lo * p / s), 0), maxq) if s > 0 else 0.0
            s = s if s > 0 else 1.0
            q = torch.clamp(torch.round(row / s) + z, 0, maxq)
            errs.append(float(((q - z) * s - row).abs().pow(2.4).sum()))
            scales.append(s)
        m = min(errs)
        best_err.append(m)
        best_scale.append(scales[errs.index(m)])
    return best_err, best_scale


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_mse_observer_finds_the_grids_least_error(symmetric: bool, bits: int) -> None:
    """Without early stopping, the MSE observer's scales reach the brute-force least error of
    the shrink grid in every group (within 1e-5 relative: float32 against float64 sums), and
    never do worse than min-max; with the default patience they are never worse than
    min-max either, and on Gaussian weights at 4 bits they shrink most groups."""
    from infer_tool.packers.rtn import mse_qparams, qparams, quantize_codes

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(16, 8, 64, generator=gen)
    w[0, 0] = 0.0  # an all-zero group keeps scale 1
    w[1, 1] = w[1, 1].abs()  # a group without negatives (asym: zero point 0)

    def err(scale, zero):
        s, z = scale.unsqueeze(-1).double(), zero.unsqueeze(-1).double()
        return ((quantize_codes(w, scale.unsqueeze(-1), zero.unsqueeze(-1), bits).double() - z) * s - w.double()).abs()

    ref_err, ref_scale = _mse_reference(w, bits, symmetric)
    ref_err = torch.tensor(ref_err).reshape(16, 8)
    full_s, full_z = mse_qparams(w, bits, symmetric, patience=10**6)
    got = err(full_s, full_z).pow(2.4).sum(-1)
    assert torch.all(got <= ref_err * (1 + 1e-5) + 1e-12)
    same = torch.isclose(full_s.double(), torch.tensor(ref_scale, dtype=torch.float64).reshape(16, 8), rtol=1e-5)
    assert same.float().mean() >= 0.9  # the same shrink, but where two errors tie within float32's rounding
    s0, z0 = qparams(w, bits, symmetric)
    minmax_err = err(s0, z0).pow(2.4).sum(-1)
    s, z = mse_qparams(w, bits, symmetric)
    assert torch.all(err(s, z).pow(2.4).sum(-1) <= minmax_err * (1 + 1e-6))
    assert full_s[0, 0] == 1.0 and s[0, 0] == 1.0
    if bits == 4:  # at 8 bits the range's rounding error is too small to trade for clipping
        assert (s < s0).float().mean() > 0.5


def test_observer_reaches_rtn_and_gptq_scales() -> None:
    """`observer="mse"` gives RTN the MSE observer's scales per group and GPTQ's static
    groups the same, from the original weights; "minmax" is the plain range; AWQ's scheme
    has no observer (its clip search chooses the range) and INT AWQ refuses the flag."""
    from infer_tool.calib.recipe import QuantizeOptions, scheme_from_options
    from infer_tool.packers.rtn import mse_qparams, qparams

    gen = torch.Generator().manual_seed(3)
    W = torch.randn(32, 128, generator=gen)
    X = _correlated_inputs(512, 128, seed=3)
    H = 2 * X.T @ X / X.shape[0]
    grouped = W.reshape(32, 2, 64)
    for sym in (True, False):
        want_s, want_z = mse_qparams(grouped, 4, sym)
        rtn = quantize_rtn(W, None, RTNScheme(group_size=64, symmetric=sym, observer="mse"))
        assert torch.equal(rtn.scale, want_s)
        gptq = quantize_gptq(W, H, GPTQScheme(group_size=64, symmetric=sym, observer="mse"))
        assert torch.equal(gptq.scale, want_s)
        if not sym:
            assert torch.equal(gptq.zero.float(), want_z)
        plain = quantize_gptq(W, H, GPTQScheme(group_size=64, symmetric=sym))
        assert torch.equal(plain.scale, qparams(grouped, 4, sym)[0])
        assert not torch.equal(plain.scale, gptq.scale)
    assert "mse scales" in GPTQScheme(observer="mse").describe()
    with pytest.raises(BadInput, match="'l2'.*minmax, mse"):
        GPTQScheme(observer="l2")
    with pytest.raises(BadInput, match="--observer applies to --method awq only with --fp4"):
        scheme_from_options(QuantizeOptions(model="m", method="awq", observer="mse"))
    fp4 = scheme_from_options(QuantizeOptions(model="m", method="awq", observer="mse", fp4="nvfp4"))
    assert fp4.observer == "mse" and fp4.fp4 == "nvfp4"
    assert type(scheme_from_options(QuantizeOptions(model="m", method="rtn", observer="mse"))) is RTNScheme
