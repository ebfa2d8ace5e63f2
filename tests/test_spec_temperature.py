"""Temperature > 0 against vLLM: our acceptance as vLLM's argmax drafting sees it (p(argmax q),
checked against the models' own softmax), the expected per-position acceptance of vLLM's rounds
(checked by hand and against the exact value of a constant acceptance), and the cross-check's
statistical tolerance."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from spec_tiny import V, one_thread, tiny  # noqa: F401 - one_thread applies to this module

from infer_tool.jobs.spec_profile import vllm_acceptance
from infer_tool.spec.crosscheck import Z, cross_check, sampled_per_position
from infer_tool.spec.drafts import ModelDraft, truncated_copy
from infer_tool.spec.profile import profile

T = 0.8


def test_argmax_acceptance_is_p_of_the_drafts_argmax() -> None:
    """At T > 0 a model draft's acceptance under vLLM's default argmax drafting is the target's
    tempered probability of the draft's argmax at each continuation position: recomputed here
    from the two models' logits with a softmax, not through our loop's code."""
    target = tiny(3, 0)
    draft_model = truncated_copy(target, 1)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (6, 9)]
    N = 8
    result = profile(
        "tiny",
        target,
        V,
        [ModelDraft("truncated:1", draft_model, V)],
        prompts,
        ks=[2],
        max_new_tokens=N,
        temperature=T,
        top_p=1.0,
        cost_ratio=None,
        seed=0,
        loop=False,
        n_boot=10,
        timing_rounds=1,
    )
    d = result.drafts[0]
    assert set(d.round_acceptance_argmax) == {2}
    for i, prompt in enumerate(prompts):
        seq = torch.cat([prompt, torch.tensor(result.continuations[i])])
        P = len(prompt)
        with torch.no_grad():
            p = torch.softmax(target(seq[None]).logits[0, P - 1 : -1].double() / T, -1)
            x = draft_model(seq[None]).logits[0, P - 1 : -1].argmax(-1)
        want = p[torch.arange(N), x]
        got = d.round_acceptance_argmax[2][i]
        for t in range(N):
            assert got[t] == pytest.approx(want[t : t + 2].tolist(), abs=1e-5)
    # At T = 0 the two acceptances are the same: nothing separate is kept.
    r0 = profile(
        "tiny", target, V, [ModelDraft("truncated:1", draft_model, V)], prompts, ks=[2], max_new_tokens=N,
        temperature=0.0, top_p=1.0, cost_ratio=None, seed=0, loop=False, n_boot=10, timing_rounds=1,
    )  # fmt: skip
    assert r0.drafts[0].round_acceptance_argmax == {}


def test_vllm_acceptance_follows_the_draft_sample_method() -> None:
    d = SimpleNamespace(round_acceptance={2: "sum min(p, q)"}, round_acceptance_argmax={2: "p(argmax q)"})
    assert vllm_acceptance(d, {"method": "draft_model"}, 2, T) == "p(argmax q)"
    assert vllm_acceptance(d, {"method": "draft_model", "draft_sample_method": "probabilistic"}, 2, T) == (
        "sum min(p, q)"
    )
    assert vllm_acceptance(d, {"method": "draft_model"}, 2, 0.0) == "sum min(p, q)"
    lookup = SimpleNamespace(round_acceptance={2: "p(proposal)"}, round_acceptance_argmax={})
    assert vllm_acceptance(lookup, {"method": "ngram"}, 2, T) == "p(proposal)"


def test_sampled_per_position_by_hand() -> None:
    """6 tokens, k = 2, acceptance 0 or 1. From t = 1: both accepted (t -> 4); at 4 the first
    rejected (t -> 5); at 5 the first accepted, the second not (t -> 7, done). Three drafts:
    at least 1 accepted in 2, at least 2 in 1."""
    acc = [[0.0, 0.0]] * 8
    acc[1], acc[4], acc[5] = [1.0, 1.0], [0.0, 1.0], [1.0, 0.0]
    assert sampled_per_position([acc], [[2] * 8], 6, 2, samples=3) == pytest.approx([2 / 3, 1 / 3])
    # A position with no proposal is no draft: at t = 4 nothing is drafted (t -> 5).
    assert sampled_per_position([acc], [[2, 2, 2, 2, 0, 2, 2, 2]], 6, 2, samples=1) == pytest.approx([1.0, 0.5])
    assert sampled_per_position([acc], [[0] * 8], 6, 2) is None


def test_sampled_per_position_of_a_constant_acceptance() -> None:
    """Every drafted token accepted with probability a, independently: position i is reached
    with probability a^i (exact), whatever the rounds' starting points."""
    a, n = 0.6, 200
    got = sampled_per_position([[[a, a, a]] * n] * 4, [[3] * n] * 4, n, 3, samples=16, seed=1)
    drafts = 4 * 16 * n / (1 + a + a * a + a**3)  # about: tokens per round
    for i, v in enumerate(got, 1):
        se = math.sqrt(a**i * (1 - a**i) / drafts)
        assert abs(v - a**i) < 4 * se, (i, v, a**i)


def test_cross_check_tolerance_at_temperature_above_0() -> None:
    """vLLM's share over n drafts is random: at T > 0 a gap within Z standard errors agrees,
    one beyond does not; at T = 0 only the 2% tolerance counts."""
    ours = {"d": {1: ([0.42], [0.42])}}
    theirs = {"d": {1: [0.5]}}
    se = math.sqrt(0.25 / 100)
    assert 0.08 < Z * se  # the gap is inside the statistical band at 100 drafts
    (row,) = cross_check(ours, theirs, 1, T, None, drafts={"d": {1: 100}})
    assert row.agree and row.max_diff == pytest.approx(0.08)
    (row,) = cross_check(ours, theirs, 1, T, None, drafts={"d": {1: 10_000}})
    assert not row.agree and "temperature > 0" in row.reason
    (row,) = cross_check(ours, theirs, 1, 0.0, None, drafts={"d": {1: 100}})
    assert not row.agree
