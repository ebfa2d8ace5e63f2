"""Speculative decoding on tiny random Llamas sharing a vocabulary: greedy output equals the
target's greedy output for every draft kind, acceptance counts agree with transformers'
assisted generation and with the teacher-forced β, and the truncated copy is the
target's first layers."""

import pytest
import torch
from spec_tiny import V, one_thread, tiny  # noqa: F401 - one_thread applies to this module
from transformers import LlamaConfig, LlamaForCausalLM

from infer_tool.spec.acceptance import beta, expected_tokens, summarize, vllm_rate
from infer_tool.spec.cached_lm import CachedLM
from infer_tool.spec.decode import speculative_decode, target_decode
from infer_tool.spec.drafts import ModelDraft, NgramDraft, truncated_copy
from infer_tool.spec.profile import profile
from infer_tool.spec.sampling import warp

NEW = 24


def noisy_copy(seed: int, scale: float = 0.5) -> LlamaForCausalLM:
    """The target's weights plus Gaussian noise: an independent model that agrees with
    the target often but not always."""
    model = tiny(4, 0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in model.parameters():
            w.add_(scale * w.std() * torch.randn(w.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tiny(4, 0)


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, V, (n,), generator=g) for n in (9, 14, 6)]


def drafts_of(target: LlamaForCausalLM) -> list:
    return [
        ModelDraft("other", noisy_copy(1), V),
        ModelDraft("truncated:2", truncated_copy(target, 2), V),
        NgramDraft(V, 2),
        ModelDraft("self", target, V),
    ]


def test_greedy_output_identical_for_every_draft(target, prompts) -> None:
    lm = CachedLM(target, V)
    for prompt in prompts[:2]:
        ref = target_decode(lm, prompt, NEW, 0.0, 1.0, None).tokens
        # independent reference: transformers' own greedy generation
        hf = target.generate(prompt[None], do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW)[0, len(prompt) :]
        assert torch.equal(ref, hf)
        for draft in drafts_of(target):
            for k in (1, 3):
                run = speculative_decode(lm, draft, prompt, k, NEW, 0.0, 1.0, None)
                assert torch.equal(run.tokens, ref), (draft.name, k)
                assert sum(run.accepted) + run.target_passes == NEW - 1  # the first token is the prefill's


def test_self_draft_accepts_everything(target, prompts) -> None:
    lm = CachedLM(target, V)
    run = speculative_decode(lm, ModelDraft("self", target, V), prompts[0], 3, NEW, 0.0, 1.0, None)
    assert run.target_passes == -(-(NEW - 1) // 4)  # each pass: 3 accepted + bonus, after the prefill's token
    assert all(a == d for a, d in zip(run.accepted, run.drafted))


def test_greedy_accepted_lengths_follow_teacher_forced_beta(target, prompts) -> None:
    """At temperature 0 the loop's accepted run lengths are fixed by the teacher-forced β:
    a round starting at position t (t = 1 after the prefill's token) accepts the run of
    β = 1 from t, capped at k.
    (Prompt lookup only at k = 1: for k > 1 it drafts the rest of one match rather than
    a fresh one-token lookup per position, which is what its teacher-forced β scores.)"""
    lm = CachedLM(target, V)
    for draft in drafts_of(target)[:3]:
        prompt = prompts[1]
        cont = target_decode(lm, prompt, NEW, 0.0, 1.0, None).tokens
        seq = torch.cat([prompt, cont])
        p = warp(lm.score(seq)[len(prompt) - 1 : -1], 0.0, 1.0)
        b = beta(p, draft.teacher_forced(seq, len(prompt), 0.0, 1.0)).tolist()
        assert 0 < sum(b) < NEW  # some agreement, not total
        for k in (1,) if isinstance(draft, NgramDraft) else (1, 2, 4):
            expected, t = [], 1
            while t < NEW:
                cap = min(k, NEW - t - 1)
                n = 0
                while n < cap and b[t + n] == 1.0:
                    n += 1
                expected.append(n)
                t += n + 1
            run = speculative_decode(lm, draft, prompt, k, NEW, 0.0, 1.0, None)
            assert run.accepted == expected, (draft.name, k)


def test_matches_transformers_assisted_generation(target, prompts) -> None:
    """Our greedy accepted-token count equals transformers' assisted generation with a
    constant k (target passes counted with a forward hook; accepted = new tokens - passes).
    Our first token comes from the prefill, as in vLLM; transformers drafts from the prompt,
    so it is given the prompt plus that first token."""
    draft = noisy_copy(2)
    gc = draft.generation_config
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0
    passes: list[int] = []
    hook = target.register_forward_pre_hook(lambda module, args: passes.append(1))
    lm = CachedLM(target, V)
    try:
        for k in (2, 4):
            gc.num_assistant_tokens = k
            ours = hf = 0
            for prompt in prompts:
                run = speculative_decode(lm, ModelDraft("d", draft, V), prompt, k, NEW, 0.0, 1.0, None)
                start = torch.cat([prompt, run.tokens[:1]])
                passes.clear()
                out = target.generate(
                    start[None],
                    attention_mask=torch.ones(1, len(start), dtype=torch.long),
                    assistant_model=draft,
                    do_sample=False,
                    max_new_tokens=NEW - 1,
                    min_new_tokens=NEW - 1,
                )
                hf_passes = len(passes)
                assert torch.equal(out[0, len(start) :], run.tokens[1:])
                assert run.target_passes == hf_passes  # one target pass per round in both
                hf += out.shape[1] - len(start) - hf_passes
                ours += sum(run.accepted)
            assert ours == hf
            assert 0 < ours < len(prompts) * (NEW - 1)  # some, not all, drafts accepted
    finally:
        hook.remove()


def test_truncated_copy_is_first_layers_sharing_weights(target, prompts) -> None:
    draft = truncated_copy(target, 2)
    assert len(target.model.layers) == 4 and target.config.num_hidden_layers == 4
    assert draft.model.layers[1].mlp.up_proj.weight is target.model.layers[1].mlp.up_proj.weight
    assert draft.lm_head.weight is target.lm_head.weight
    # independent reference: a fresh 2-layer model loaded with the target's tensors
    cfg = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 2})
    ref = LlamaForCausalLM(cfg).eval()
    state = {k: v for k, v in target.state_dict().items() if k in ref.state_dict()}
    ref.load_state_dict(state, strict=True)
    with torch.inference_mode():
        a = draft(prompts[0][None]).logits
        b = ref(prompts[0][None]).logits
    assert torch.allclose(a, b, atol=1e-5)
    # teacher-forced and cached scoring agree
    md = ModelDraft("t", draft, V)
    md.start()
    step = md.lm.extend(prompts[0])
    assert torch.allclose(step, a[0], atol=1e-5)


def test_teacher_forced_beta_equals_step_by_step(target, prompts) -> None:
    """β from the single teacher-forced pass equals β from cached step-by-step logits."""
    draft = ModelDraft("other", tiny(2, 1), V)
    lm = CachedLM(target, V)
    prompt = prompts[2]
    cont = target_decode(lm, prompt, NEW, 0.9, 0.95, torch.Generator().manual_seed(0)).tokens
    seq = torch.cat([prompt, cont])
    P = len(prompt)
    tf = beta(warp(lm.score(seq)[P - 1 : -1], 0.9, 0.95), draft.teacher_forced(seq, P, 0.9, 0.95))
    stepwise = []
    lm.reset()
    draft.start()
    for t in range(P, len(seq)):
        p = warp(lm.extend(seq[:t])[-1], 0.9, 0.95)
        q = warp(draft.lm.extend(seq[:t])[-1], 0.9, 0.95)
        stepwise.append(float(torch.minimum(p, q).sum()))
    assert torch.allclose(tf, torch.tensor(stepwise), atol=1e-4)
    # β = 1 − total variation distance
    p, q = warp(lm.score(seq), 0.9, 0.95), draft.teacher_forced(seq, 1, 0.9, 0.95)
    assert torch.allclose(beta(p[:-1], q), 1 - 0.5 * (p[:-1] - q).abs().sum(-1), atol=1e-5)


def test_sampled_loop_and_profile(target, prompts) -> None:
    """Temperature > 0: the loop emits the asked tokens; the profile's numbers are consistent."""
    drafts = drafts_of(target)[1:3]
    result = profile(
        "tiny",
        target,
        V,
        drafts,
        prompts,
        ks=[1, 3],
        max_new_tokens=12,
        temperature=1.0,
        top_p=0.9,
        cost_ratio=None,
        seed=0,
        n_boot=200,
        timing_rounds=2,
    )
    assert [d.name for d in result.drafts] == ["truncated:2", "prompt-lookup:2"]
    assert result.basis == "measured" and result.tokens == len(prompts) * 11
    for d in result.drafts:
        lo, hi = d.acceptance.alpha_ci
        assert 0.0 <= lo <= d.acceptance.alpha <= hi <= 1.0
        assert len(d.acceptance.per_prompt) == len(prompts) and len(d.acceptance.per_position) == 12
        for r in d.per_k:
            assert sum(r.accepted_hist) == r.target_passes
            assert r.measured_tokens == pytest.approx(len(prompts) * 11 / r.target_passes)
            assert r.alpha_tokens == pytest.approx(expected_tokens(d.acceptance.alpha, r.k))
            assert r.error == pytest.approx(r.predicted_speedup / r.measured_speedup - 1)
            assert r.greedy_identical is None
        assert d.best_k == max(d.per_k, key=lambda r: r.measured_speedup).k
    assert {r["name"] for r in result.ranking} == {"truncated:2", "prompt-lookup:2"}
    speeds = [r["measured_speedup"] for r in result.ranking]
    assert speeds == sorted(speeds, reverse=True)


def test_speedup_formulas() -> None:
    # closed forms against explicit sums: E[tokens] = Σ_{i=0..k} α^i
    for a in (0.0, 0.3, 0.8, 0.99):
        for k in (1, 4, 7):
            assert expected_tokens(a, k) == pytest.approx(sum(a**i for i in range(k + 1)))
            assert vllm_rate(a, k) == pytest.approx(sum(a**i for i in range(1, k + 1)) / k)
    assert vllm_rate(0.8, 5) == pytest.approx(0.54, abs=0.005)  # the vLLM example
    assert expected_tokens(1.0, 3) == 4.0


def test_bootstrap_interval() -> None:
    g = torch.Generator().manual_seed(0)
    betas = [torch.rand(20, generator=g) for _ in range(30)]
    acc = summarize(betas, 500, 0)
    assert acc.alpha == pytest.approx(float(torch.cat(betas).mean()))
    lo, hi = acc.alpha_ci
    # the prompt means are i.i.d. with sd ~ 0.289/sqrt(20*30): the 95% interval has
    # half-width ~ 1.96 * 0.0118
    assert lo < acc.alpha < hi and 0.015 < hi - lo < 0.07
