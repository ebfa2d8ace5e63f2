"""Speedup predictions: the recursion over positions against a Monte-Carlo run of the same
loop rules, the α formula against the recursion at constant acceptance, vLLM's metric
definitions, and a whole profile under a fake timing model (models whose passes cost a
fixed CPU time per call and per token) where v(k) grows with k, or stays flat."""

import functools
import random
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from infer_tool.spec.acceptance import expected_tokens
from infer_tool.spec.drafts import ModelDraft
from infer_tool.spec.predict import (
    alpha_prediction,
    outcome_probs,
    sequence_prediction,
    vllm_measured,
    vllm_predicted,
)
from infer_tool.spec.profile import profile
from infer_tool.spec.ranking import best

V = 96


class FakeCosts:
    """RoundCosts with v(m) = 1 + slope·m and a draft costing `token` per drafted token,
    `call` per round and `catch_up` extra after a fully accepted round."""

    def __init__(self, slope: float, token: float, call: float = 0.0, catch_up: float = 0.0):
        self.slope, self.token, self.call, self.catch_up = slope, token, call, catch_up

    def verify(self, m: int) -> float:
        return 1.0 + self.slope * m

    def draft(self, m: int, catch_up: bool) -> float:
        return self.call + self.token * m + (self.catch_up if catch_up else 0.0)


def simulate(acceptance: list[list[float]], k: int, costs: FakeCosts, rng: random.Random) -> tuple[float, int]:
    """One run of spec.decode's rules with random acceptances: (cost, target passes)."""
    N, t, catch_up, cost, passes = len(acceptance), 1, False, 0.0, 0
    while t < N:
        kk = min(k, N - t - 1)
        passes += 1
        if kk == 0:
            cost, t, catch_up = cost + costs.verify(0), t + 1, False
            continue
        a = acceptance[t][:kk]
        cost += costs.draft(len(a), catch_up) + costs.verify(len(a))
        j = 0
        while j < len(a) and rng.random() < a[j]:
            j += 1
        catch_up = 0 < len(a) == j
        t += j + 1
    return cost, passes


def test_sequence_prediction_matches_simulation() -> None:
    rng = random.Random(0)
    N = 11
    # model-draft-like windows and prompt-lookup-like proposals of varying length
    windows = [[rng.random() for _ in range(4)] for _ in range(N)]
    lookups = [[rng.random() for _ in range(rng.choice([0, 1, 3, 4]))] for _ in range(N)]
    costs = FakeCosts(slope=0.3, token=0.2, call=0.05, catch_up=0.1)
    for acceptance in (windows, lookups):
        for k in (1, 2, 4):
            e = sequence_prediction(acceptance, k, costs)
            runs = [simulate(acceptance, k, costs, rng) for _ in range(20000)]
            assert e.tokens == N - 1
            # standard errors are ~0.2% of the means: 1% is > 5 of them
            assert e.cost == pytest.approx(sum(c for c, _ in runs) / len(runs), rel=0.01)
            assert e.passes == pytest.approx(sum(p for _, p in runs) / len(runs), rel=0.01)


def test_constant_acceptance_tends_to_the_alpha_formula() -> None:
    """(1 − α^(k+1))/(1 − α) over k·c + v(k) (catch-up at rate α^k) is the recursion's
    long-sequence limit."""
    costs = FakeCosts(slope=0.4, token=0.1, catch_up=0.05)
    for alpha in (0.3, 0.8):
        for k in (1, 3, 6):
            e = sequence_prediction([[alpha] * k] * 4000, k, costs)
            a = alpha_prediction(alpha, k, costs)
            full = alpha**k
            assert a.draft_cost == pytest.approx(0.1 * k + 0.05 * full)
            assert a.speedup == pytest.approx(expected_tokens(alpha, k) / (0.1 * k + 0.05 * full + 1 + 0.4 * k))
            assert e.tokens / e.cost == pytest.approx(a.speedup, rel=0.005)
            assert e.tokens / e.passes == pytest.approx(a.tokens, rel=0.005)


def test_growing_verify_cost_moves_best_k_down() -> None:
    """The same acceptance, two timing models: v(k) = 1 (a large model on a GPU at batch 1)
    favours long lookaheads, v(k) = 1 + k (each extra token a full step) makes every k lose."""
    acceptance = [[0.8] * 8] * 200
    ks = [1, 2, 3, 4, 6, 8]
    flat = [sequence_prediction(acceptance, k, FakeCosts(0.0, 0.05)) for k in ks]
    steep = [sequence_prediction(acceptance, k, FakeCosts(1.0, 0.05)) for k in ks]
    flat_speed = [e.tokens / e.cost for e in flat]
    steep_speed = [e.tokens / e.cost for e in steep]
    assert ks[flat_speed.index(max(flat_speed))] >= 4
    assert steep_speed == sorted(steep_speed, reverse=True) and max(steep_speed) < 1.0
    assert [e.passes for e in flat] == pytest.approx([e.passes for e in steep])  # acceptance is not timing


def test_outcome_probs_and_vllm_definitions() -> None:
    assert outcome_probs([0.5, 0.4]) == pytest.approx([0.5, 0.3, 0.2])
    assert outcome_probs([]) == [1.0]
    # vLLM counts a draft only when tokens were proposed (the last round drafted none)
    m = vllm_measured(accepted=[0, 2, 1, 0], drafted=[2, 2, 2, 0], k=2)
    assert m.mean_acceptance_length == pytest.approx(1 + 3 / 3)
    assert m.acceptance_rate == pytest.approx(3 / 6)
    assert m.per_position == pytest.approx([2 / 3, 1 / 3])
    assert vllm_measured([0, 0], [0, 0], 3) is None
    p = vllm_predicted(0.8, 5)
    assert p.per_position == pytest.approx([0.8**i for i in range(1, 6)])
    assert p.mean_acceptance_length == pytest.approx(expected_tokens(0.8, 5))
    assert p.acceptance_rate == pytest.approx(0.54, abs=0.005)  # the README's example


# --- a whole profile under a fake timing model ---------------------------------------


def tiny(seed: int, noise: float = 0.0) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in model.parameters():
            w.add_(noise * w.std() * torch.randn(w.shape, generator=g))
    return model


def priced(model: LlamaForCausalLM, base_ms: float, per_token_ms: float) -> LlamaForCausalLM:
    """Each forward costs max(its compute, base + per_token · new tokens) of CPU time."""
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        end = time.thread_time() + (base_ms + per_token_ms * ids.shape[-1]) / 1000
        out = inner(*args, **kwargs)
        while time.thread_time() < end:
            pass
        return out

    model.forward = forward
    return model


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the thread's CPU time is then the model's whole cost
    yield
    torch.set_num_threads(before)


def price_scale(model: LlamaForCausalLM, draft_ms: float) -> float:
    """How much to raise every price so that the cheapest one (the draft's `draft_ms`) is at
    least 1.5x the tiny model's own compute per forward on this CPU: the fake's costs are then
    its prices, on a slow CPU too (a 2-layer model's forward is a few ms of Python on some)."""
    ids = torch.randint(0, V, (1, 32), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.no_grad():
        for _ in range(5):
            t = time.thread_time()
            model(input_ids=ids)
            times.append(time.thread_time() - t)
    return max(1.0, 1.5 * max(times[1:]) * 1000 / draft_ms)


@pytest.mark.parametrize("base_ms,per_token_ms,best_k", [(8.0, 0.1, 3), (2.0, 3.0, 1)])
def test_profile_follows_fake_timing(base_ms, per_token_ms, best_k) -> None:
    """v(k) flat (a large model on a GPU at batch 1): k = 3 wins; v(k) = 1 + 0.6k (a CPU):
    every k loses, k = 1 least. The prediction, the loop and the ranking all follow. Every
    price is scaled alike (`price_scale`), which changes no ratio."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (9, 14)]
    f = price_scale(tiny(1, noise=0.2), 0.8)
    base_ms, per_token_ms = base_ms * f, per_token_ms * f
    target = priced(tiny(0), base_ms, per_token_ms)
    draft = ModelDraft("noisy", priced(tiny(1, noise=0.2), 0.8 * f, 0.0), V)  # alpha ~ 0.6
    result = profile(
        "fake",
        target,
        V,
        [draft],
        prompts,
        ks=[1, 3],
        max_new_tokens=16,
        temperature=0.0,
        top_p=1.0,
        cost_ratio=None,
        seed=0,
        n_boot=100,
        timing_rounds=3,
        clock=time.thread_time,
    )
    d = result.drafts[0]
    assert 0.3 < d.acceptance.alpha < 0.9
    v3 = (base_ms + 4 * per_token_ms) / (base_ms + per_token_ms)  # the fake's own v(3)
    assert result.verify_costs[3] == pytest.approx(v3, rel=0.15)
    for r in d.per_k:
        assert r.predicted_tokens == pytest.approx(r.measured_tokens)  # T = 0: the loop's own rounds
        assert abs(r.error) < 0.2, (r.k, r.predicted_speedup, r.measured_speedup)
    assert best(d.per_k, "predicted").k == best_k  # the prediction follows v(k) ...
    assert d.best_k == best_k and result.basis == "measured"  # ... and so does the measurement
    if best_k == 1:
        assert d.slower_everywhere and "slower than plain decoding at every k" in result.ranking[0]["reason"]
    else:
        assert not d.slower_everywhere and d.per_k[-1].measured_speedup > 1.0
