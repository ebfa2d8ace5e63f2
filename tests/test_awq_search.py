"""AWQ's fast ratio search (coarse to fine over the grid) against the full grid.

The reference is the full grid itself: every ratio evaluated, the first smallest loss kept
when it beats plain RTN. The fast search must choose the same ratio wherever the loss over
the grid is unimodal (checked on every unimodal shape of a 20-point grid's minimum and on
random curves), fall back to the full grid where the points it sees are not unimodal, and,
on the tiny model of every architecture in the table, pick the same ratios and so write the
same weights bit for bit.
"""

from __future__ import annotations

import random

import pytest
import torch

from infer_tool.calib.architectures import ARCHITECTURES
from infer_tool.common.errors import BadInput
from infer_tool.packers.awq import awq_search_scale, choose, screen_grid, search_grid, unimodal
from infer_tool.schemes.integer import AWQScheme
from infer_tool.schemes.registry import make_scheme


@pytest.fixture(autouse=True, scope="module")
def one_thread():  # noqa: ANN201
    """Tiny tensors: a thread pool's barriers cost more than they save on shared cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def run(curve: list[float], search: str, step: int = 4) -> tuple[int | None, set[int], bool]:
    """(chosen index with RTN at +inf, indices evaluated, fell back) of `search` on `curve`."""
    seen: dict[int, float] = {}

    def loss_at(i: int) -> float:
        seen[i] = curve[i]
        return curve[i]

    fell_back = search_grid(loss_at, len(curve), search, step)
    return choose([seen.get(i) for i in range(len(curve))], float("inf")), set(seen), fell_back


def unimodal_curve(n: int, k: int, rng: random.Random) -> list[float]:
    """Strictly decreasing to index k, strictly increasing after, random steps."""
    curve = [0.0] * n
    curve[k] = rng.uniform(0.5, 1.0)
    for i in range(k - 1, -1, -1):
        curve[i] = curve[i + 1] + rng.uniform(1e-6, 1.0)
    for i in range(k + 1, n):
        curve[i] = curve[i - 1] + rng.uniform(1e-6, 1.0)
    return curve


@pytest.mark.parametrize("n,step", [(20, 4), (20, 5), (20, 3), (10, 4), (7, 2), (3, 2)])
def test_fast_search_finds_the_minimum_of_every_unimodal_curve(n: int, step: int) -> None:
    """Every position of the minimum, 30 random shapes each: the fast search picks the full
    grid's index without falling back, in at most 12 of 20 evaluations at step 4."""
    rng = random.Random(n * 100 + step)
    most = 0
    for k in range(n):
        for _ in range(30):
            curve = unimodal_curve(n, k, rng)
            full, evaluated_full, _ = run(curve, "full", step)
            fast, evaluated, fell_back = run(curve, "fast", step)
            assert evaluated_full == set(range(n))
            assert fast == full == k and not fell_back, (curve, sorted(evaluated))
            most = max(most, len(evaluated))
    if (n, step) == (20, 4):
        assert most <= 12


def test_not_unimodal_coarse_points_fall_back_to_the_full_grid() -> None:
    """Two valleys the coarse points see: every point is evaluated and the global minimum kept."""
    curve = [5, 4, 3, 2, 1.5, 2, 3, 4, 5, 4, 3, 2, 1.0, 2, 3, 4, 5, 6, 7, 8]
    fast, evaluated, fell_back = run(curve, "fast")
    assert fell_back and evaluated == set(range(20)) and fast == 12


def test_ties_fall_back_to_the_full_grid() -> None:
    """A flat bottom: the choice would depend on the points looked at, so the full grid decides (first of equals)."""
    curve = [9, 8, 7, 6, 5, 4, 3, 2, 1, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    fast, evaluated, fell_back = run(curve, "fast")
    full, _, _ = run(curve, "full")
    assert fell_back and evaluated == set(range(20)) and fast == full == 8


def test_a_dip_between_coarse_points_is_the_known_limit() -> None:
    """What the fast search cannot see: a dip at an index no coarse or bracket point falls
    on, while every point seen is unimodal. It then keeps the bracket's minimum; the full
    grid finds the dip. (Measured on the demo model and the tiny architectures instead.)"""
    curve = [float(abs(i - 12)) + 1 for i in range(20)]
    curve[2] = 0.5
    fast, evaluated, fell_back = run(curve, "fast")
    assert 2 not in evaluated and not fell_back and fast == 12
    assert run(curve, "full")[0] == 2


def test_unimodal() -> None:
    assert unimodal([3, 2, 1]) and unimodal([1, 2, 3]) and unimodal([2, 1, 2]) and unimodal([1])
    assert not unimodal([1, 2, 1]) and not unimodal([2, 1, 1, 2]) and not unimodal([2, 1, 2, 1, 2])


def test_scheme_refuses_unknown_search() -> None:
    assert AWQScheme().search == "screen"
    assert make_scheme("awq", search="full").search == "full"
    with pytest.raises(BadInput, match="fast, full, screen"):
        make_scheme("awq", search="golden")
    with pytest.raises(BadInput, match="search_step"):
        make_scheme("awq", search_step=1)
    with pytest.raises(BadInput, match="screen_margin"):
        make_scheme("awq", screen_margin=0.0)


def screened(curve: list[float], noise: list[float], margin: float) -> tuple[int | None, set[int], bool, float]:
    """(chosen index with RTN at +inf, indices evaluated exactly, fell back, error seen) of the
    screened search when the screen returns curve[i]·(1 + noise[i])."""
    seen: dict[int, float] = {}

    def loss_at(i: int) -> float:
        seen[i] = curve[i]
        return curve[i]

    _, error, final = screen_grid(loss_at, lambda i: curve[i] * (1 + noise[i]), len(curve), margin)
    return choose([seen.get(i) for i in range(len(curve))], float("inf")), set(seen), final == float("inf"), error


@pytest.mark.parametrize("seed", range(200))
def test_screen_finds_the_exact_minimum_while_its_error_is_within_the_bound(seed: int) -> None:
    """Any curve (not only unimodal ones) and a screen erring by up to ε/2 = margin/(2+margin)/2
    at every point: the exact minimum is always among the points scored again, the search
    does not fall back, and it scores only the points within the margin."""
    rng = random.Random(seed)
    n, margin = 20, rng.choice([0.02, 0.1, 0.3])
    curve = [rng.uniform(1.0, 1.5) for _ in range(n)]
    bound = margin / (2 + margin) / 2
    noise = [rng.uniform(-bound, bound) * 0.999 for _ in range(n)]
    chosen, looked, fell_back, error = screened(curve, noise, margin)
    assert chosen == min(range(n), key=curve.__getitem__) and not fell_back
    assert error <= bound
    lo = [c * (1 + e) for c, e in zip(curve, noise)]
    three = set(sorted(range(n), key=lo.__getitem__)[:3])
    assert looked == three | {i for i in range(n) if lo[i] <= (1 + margin) * min(lo)}


def test_a_screen_erring_more_than_assumed_falls_back_to_the_full_grid() -> None:
    """The screen puts the true minimum (index 3) 40% too high, out of the margin, and index
    0 30% too low: the three smallest screened losses (0, 1, 2) scored again disagree with
    the screen by a spread of (1 - 0.7)/(1 + 0.7), which calls for a margin wider than the
    whole grid: every point is then scored exactly. A constant factor on every screened
    loss is no error at all."""
    curve = [1.0 + 0.01 * i for i in range(20)]
    curve[3] = 0.9
    noise = [0.0] * 20
    noise[3], noise[0] = 0.4, -0.3
    chosen, looked, fell_back, error = screened(curve, noise, 0.1)
    assert fell_back and looked == set(range(20)) and chosen == 3 and error == pytest.approx(0.7 / 2.1)
    chosen, looked, fell_back, error = screened(curve, [0.5] * 20, 0.03)
    assert chosen == 3 and not fell_back and error == pytest.approx(0.0, abs=1e-15) and looked == {0, 1, 3}


def test_the_margin_widens_to_the_error_measured_near_the_minimum() -> None:
    """A screen erring +1.5% at the minimum (index 10) and -1.5% at its neighbours, with a 1%
    starting margin: the spread measured on the three best screened points (0.015) calls
    for a margin of 4·0.015/0.97 ≈ 6.2% around the smallest screened loss (0.99485), which
    takes in indices 5..15 and stops there, short of the full grid."""
    curve = [1.0 + 0.01 * abs(i - 10) for i in range(20)]
    noise = [0.0] * 20
    noise[10], noise[9], noise[11] = 0.015, -0.015, -0.015
    chosen, looked, fell_back, error = screened(curve, noise, 0.01)
    assert chosen == 10 and not fell_back and looked == set(range(5, 16))
    assert error == pytest.approx(0.015, rel=1e-6)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("symmetric", [True, False])
def test_screened_and_full_choose_the_same_scales(seed: int, symmetric: bool) -> None:
    """On a real block search with the block screened in bfloat16: the same ratio and
    bit-identical scales as the full grid, the losses it scored exactly are the full grid's
    bit for bit, and it scores fewer of them in float32 when it does not fall back."""
    x_mean, weights, block, ref = _block_problem(seed)

    def block_lo(ws: list[torch.Tensor]) -> torch.Tensor:
        return block([w.to(torch.bfloat16).float() for w in ws]).to(torch.bfloat16)

    full = awq_search_scale(x_mean, weights, block, ref, AWQScheme(group_size=32, symmetric=symmetric, search="full"))
    scheme = AWQScheme(group_size=32, symmetric=symmetric, search="screen")
    fast = awq_search_scale(x_mean, weights, block, ref, scheme, screen=(block_lo, block_lo(weights)))
    assert fast.ratio == full.ratio and torch.equal(fast.scales, full.scales)
    assert all(v is None or v == full.losses[i] for i, v in enumerate(fast.losses))
    assert fast.search == "screen" and len(fast.screen_losses) == 20 and fast.screen_rtn_loss > 0
    # plain RTN is scored exactly only where it may be the minimum; here it never is
    assert fast.rtn_loss is None or fast.rtn_loss == full.rtn_loss
    assert full.rtn_loss > full.best_loss and fast.best_loss == full.best_loss
    assert fast.evaluated == 20 if fast.fell_back else fast.evaluated < 20
    summary = fast.summary()
    assert summary["search"] == "screen" and summary["screen_error"] == fast.screen_error
    # Without a screen (or with a Gram matrix), "screen" is the full grid.
    plain = awq_search_scale(x_mean, weights, block, ref, scheme)
    assert plain.search == "full" and plain.evaluated == 20 and plain.ratio == full.ratio


def _block_problem(seed: int):
    """A norm feeding two balanced linears on correlated inputs with salient channels."""
    gen = torch.Generator().manual_seed(seed)
    K = 128
    x = torch.randn(512, K, generator=gen) @ (torch.eye(K) + 0.3 * torch.randn(K, K, generator=gen))
    x[:, ::16] *= 10  # salient input channels, what AWQ protects
    weights = [torch.randn(64, K, generator=gen), torch.randn(32, K, generator=gen)]

    def block(ws: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([torch.relu(x @ w.T) for w in ws], dim=-1)

    return x.abs().mean(0), weights, block, block(weights)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("symmetric", [True, False])
def test_fast_and_full_choose_the_same_scales(seed: int, symmetric: bool) -> None:
    """On a real block search: the same ratio and bit-identical scales, at most the full
    grid's evaluations; the losses the fast search evaluated are the full grid's, bit for
    bit; the full grid's report of the fast choice is what the fast run chose."""
    x_mean, weights, block, ref = _block_problem(seed)
    full = awq_search_scale(x_mean, weights, block, ref, AWQScheme(group_size=32, symmetric=symmetric, search="full"))
    fast = awq_search_scale(x_mean, weights, block, ref, AWQScheme(group_size=32, symmetric=symmetric, search="fast"))
    assert fast.ratio == full.ratio and torch.equal(fast.scales, full.scales)
    assert full.evaluated == 20 and fast.evaluated == (20 if fast.fell_back else fast.evaluated) <= 20
    assert fast.fell_back or unimodal([v for v in fast.losses if v is not None])
    assert all(v is None or v == full.losses[i] for i, v in enumerate(fast.losses))
    assert full.fast_ratio == fast.ratio and full.fast_loss == fast.best_loss
    assert full.summary()["fast_loss_excess"] == 0.0 and fast.summary()["fell_back"] is fast.fell_back


TINY_TYPES = [
    t for t, a in ARCHITECTURES.items() if t != "gpt2" and a.moe is None
]  # gpt2: Conv1D, no INT4 format; MoE: tests/test_moe*.py


@pytest.fixture
def bf16_screen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The screen runs as on a CPU with native bfloat16 matmuls (oneDNN's AVX-512 BF16 / AMX),
    on every CPU class: without them torch emulates bfloat16, slower but the same search, so
    the screen's logic is tested on an AVX2-only CPU too. Where it runs by default is
    `native_low_precision`'s call (`test_screen_is_the_full_grid_without_native_bfloat16`)."""
    from infer_tool.calib.quantizers import awq, awq_screen

    monkeypatch.setattr(awq_screen, "native_low_precision", lambda device: True)
    monkeypatch.setattr(awq, "native_low_precision", lambda device: True)


@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_tiny_architectures_fast_equals_full(model_type: str, bf16_screen: None) -> None:
    """The pipeline tests' tiny model of each architecture: the fast search writes the same
    weights bit for bit (their losses over alpha are rarely unimodal: it mostly falls back),
    each report entry says which search ran, and the full grid's entries name the ratio the
    fast search would choose on the same losses."""
    from test_pipeline import ids, tiny_model

    from infer_tool.calib.pipeline import quantize_model
    from infer_tool.calib.quantizers.awq import AWQQuantizer

    runs = {}
    for search in ("full", "fast", "screen"):
        scheme = make_scheme("awq", group_size=32, search=search)
        runs[search] = (quantize_model(tiny_model(model_type), ids(), scheme, batch_size=4, device="cpu"), scheme)
    (full, full_scheme), (fast, fast_scheme) = runs["full"], runs["fast"]
    assert full.quantized.keys() == fast.quantized.keys()
    for name, qw in full.quantized.items():
        assert torch.equal(qw.dequantize(torch.float32), fast.quantized[name].dequantize(torch.float32)), name
    a = [e for e in full.method_report["awq"] if "losses" in e]
    b = [e for e in fast.method_report["awq"] if "losses" in e]
    assert a and len(a) == len(b)
    for x, y in zip(a, b):
        assert x["search"] == "full" and y["search"] == "fast" and x["ratio"] == y["ratio"] == x["fast_ratio"]
        assert x["evaluated"] == 20 and y["evaluated"] <= 20 and x["fast_loss_excess"] == 0.0
    screen, screen_scheme = runs["screen"]
    for name, qw in full.quantized.items():
        assert torch.equal(qw.dequantize(torch.float32), screen.quantized[name].dequantize(torch.float32)), name
    c = [e for e in screen.method_report["awq"] if "losses" in e]
    assert [x["ratio"] for x in a] == [z["ratio"] for z in c]
    assert {z["search"] for z in c} == {"screen"}  # up -> down too: its Gram-matrix loss screened with H in bfloat16
    assert "screened in bfloat16" in AWQQuantizer().notes(screen, screen_scheme)[0]
    assert "would choose the same ratio on" in AWQQuantizer().notes(full, full_scheme)[0]
    assert "grid evaluations" in AWQQuantizer().notes(fast, fast_scheme)[0]


def test_screen_edge_cases_end() -> None:
    """Zero and infinite screened losses, and a screen that is all zeros: the search ends,
    and scores everything exactly when the screen tells it nothing."""
    curve = [1.0 + 0.01 * i for i in range(20)]
    assert screened(curve, [-1.0] * 20, 0.01)[2]  # every screened loss 0: the full grid
    chosen, looked, fell_back, _ = screened([0.0] * 20, [0.0] * 20, 0.01)
    assert chosen == 0 and len(looked) == 20  # every screened loss ties with the smallest: all scored, the first wins


@pytest.mark.parametrize("model_type", TINY_TYPES + ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_screen_attention_is_sdpa(model_type: str) -> None:
    """The screen's attention (plain matmuls and a softmax) computes what transformers' sdpa
    attention does, on the tiny model of every architecture (GQA, MLA, sliding windows,
    biases) in float32: the same logits to 1e-5 relative, padded batches included (their
    mask is a tensor, not is_causal). What sdpa refuses (gemma2's softcap) it refuses too."""
    from test_pipeline import ids, tiny_model
    from tiny_moe import make_moe

    from infer_tool.calib.quantizers.awq_screen import screen_attention_name

    model = (
        make_moe(model_type)
        if model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
        else tiny_model(model_type)
    )
    x = ids()
    mask = torch.ones_like(x)
    mask[0, :5] = 0  # left padding
    logits, errors = {}, {}
    for impl in ("sdpa", screen_attention_name()):
        model.config._attn_implementation = impl
        try:
            with torch.no_grad():
                logits[impl] = [
                    model(input_ids=x, use_cache=False).logits,
                    model(input_ids=x, attention_mask=mask, use_cache=False).logits[:, 5:],
                ]
        except ValueError as e:  # gemma2's softcap: sdpa refuses it, and the screen hands it to sdpa
            errors[impl] = str(e)
    if errors:
        assert len(set(errors.values())) == 1 and len(errors) == 2 and "softcap" in errors["sdpa"], errors
        return
    for a, b in zip(*logits.values()):
        assert torch.isfinite(b).all()
        assert (a - b).norm() <= 1e-5 * a.norm(), (a - b).norm() / a.norm()


def test_screen_block_runs_its_attention_as_screen_attention(monkeypatch, bf16_screen: None) -> None:
    """On a CPU the bfloat16 copy of an sdpa attention block runs `screen_attention`; the
    model's own block keeps sdpa (the copy has its own config); the copy's output is the
    float32 block's to bfloat16 precision (3% relative)."""
    from test_pipeline import tiny_model
    from transformers import AttentionInterface

    from infer_tool.calib.layers import LayerCall
    from infer_tool.calib.quantizers import awq_screen

    model = tiny_model("llama")
    model.config._attn_implementation = "sdpa"
    attn = model.model.layers[0].self_attn
    h = torch.randn(3, 16, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    calls = [
        LayerCall(
            (h[:2],), {"position_embeddings": model.model.rotary_emb(h, torch.arange(16)[None]), "attention_mask": None}
        ),
        LayerCall(
            (h[2:],), {"position_embeddings": model.model.rotary_emb(h, torch.arange(16)[None]), "attention_mask": None}
        ),
    ]
    balance = [attn.q_proj, attn.k_proj, attn.v_proj]
    forward = awq_screen.low_precision_block(attn, balance, calls, conv1d=False)
    seen = []
    name = awq_screen.screen_attention_name()
    monkeypatch.setitem(
        AttentionInterface._global_mapping, name, lambda *a, **k: seen.append(1) or awq_screen.screen_attention(*a, **k)
    )
    out = forward([b.weight.detach() for b in balance])
    assert len(seen) == 2 and model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        ref = torch.cat([attn(c.args[0], **c.kwargs)[0] for c in calls])
    assert out.dtype == torch.bfloat16 and (out.float() - ref).norm() <= 0.03 * ref.norm()


def test_screen_is_the_full_grid_without_native_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without native bfloat16 matmuls (AVX2 only, e.g. AMD Zen 3): --awq-search screen
    builds no bfloat16 copy and scores every mapping on the full grid, exactly; the weights
    are the full grid's bit for bit and the report and note say nothing was screened."""
    from test_pipeline import ids, tiny_model

    from infer_tool.calib.layers import LayerCall
    from infer_tool.calib.pipeline import quantize_model
    from infer_tool.calib.quantizers import awq, awq_screen
    from infer_tool.calib.quantizers.awq import AWQQuantizer

    monkeypatch.setattr(awq_screen, "native_low_precision", lambda device: False)
    monkeypatch.setattr(awq, "native_low_precision", lambda device: False)
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    h = torch.randn(1, 8, model.config.hidden_size)
    call = LayerCall((h,), {"position_embeddings": model.model.rotary_emb(h, torch.arange(8)[None])})
    assert awq_screen.low_precision_block(attn, [attn.q_proj], [call], conv1d=False) is None
    runs = {}
    for search in ("full", "screen"):
        scheme = make_scheme("awq", group_size=32, search=search)
        runs[search] = (quantize_model(tiny_model("llama"), ids(), scheme, batch_size=4, device="cpu"), scheme)
    (full, _), (screen, screen_scheme) = runs["full"], runs["screen"]
    for name, qw in full.quantized.items():
        assert torch.equal(qw.dequantize(torch.float32), screen.quantized[name].dequantize(torch.float32)), name
    entries = [e for e in screen.method_report["awq"] if "losses" in e]
    assert entries and {e["search"] for e in entries} == {"full"}
    assert all(e["evaluated"] == 20 for e in entries)
    assert f"0 of {len(entries)} mappings screened" in AWQQuantizer().notes(screen, screen_scheme)[0]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("symmetric", [True, False])
def test_gram_loss_screened_in_bfloat16_chooses_as_the_full_grid(seed: int, symmetric: bool) -> None:
    """up -> down (a Gram-matrix loss): screened with ΔW and H in bfloat16, the same ratio and
    scales as the full grid, its float32 losses the full grid's bit for bit, fewer of them."""
    gen = torch.Generator().manual_seed(seed)
    K, T = 128, 512
    x = torch.randn(T, K, generator=gen) @ (torch.eye(K) + 0.3 * torch.randn(K, K, generator=gen))
    x[:, ::16] *= 10
    w = torch.randn(48, K, generator=gen)
    gram = (x.T @ x, T)
    full = awq_search_scale(
        x.abs().mean(0), [w], None, None, AWQScheme(group_size=32, symmetric=symmetric, search="full"), gram=gram
    )
    scheme = AWQScheme(group_size=32, symmetric=symmetric, search="screen")
    fast = awq_search_scale(x.abs().mean(0), [w], None, None, scheme, gram=gram, gram_lo=gram[0].to(torch.bfloat16))
    assert fast.search == "screen" and fast.ratio == full.ratio and torch.equal(fast.scales, full.scales)
    assert all(v is None or v == full.losses[i] for i, v in enumerate(fast.losses))
    assert fast.evaluated == 20 if fast.fell_back else fast.evaluated < 20
    assert awq_search_scale(x.abs().mean(0), [w], None, None, scheme, gram=gram).search == "full"  # no bfloat16 H
