"""Our loop batched (`spec/batched.py`, `spec/batch_table.py`): the batch's padded, masked
passes against batch-1 passes, every sequence's rounds against the batch-1 loop (the oracle)
at temperature 0 and above, and the table measured by our loop."""

from __future__ import annotations

import pytest
import torch
from spec_tiny import V, one_thread, tiny  # noqa: F401 - one_thread applies to this module

from infer_tool.spec.batch_table import measure
from infer_tool.spec.batched import BatchedLM, batched, batched_speculative_decode, batched_target_decode
from infer_tool.spec.cached_lm import CachedLM
from infer_tool.spec.decode import speculative_decode, target_decode
from infer_tool.spec.drafts import ModelDraft, NgramDraft, truncated_copy
from infer_tool.spec.vllm_engine import schedule

N = 16


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny(4, 0)


def _prompts() -> list[torch.Tensor]:
    """Four prompts of different lengths, each repeating itself (so prompt lookup proposes)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for n in (5, 9, 13, 7):
        base = torch.randint(0, V, (n,), generator=g)
        out.append(torch.cat([base, base[:3], base]))
    return out


def test_padded_masked_passes_match_batch_1(target: torch.nn.Module) -> None:
    """Ragged feeds (left-padded), rollbacks that leave dead slots and a row leaving the batch
    give each row the logits it gets alone (float32, 1e-4)."""
    prompts = [p.tolist() for p in _prompts()[:3]]
    b = BatchedLM(target, V)
    b.reset(3)
    alone = [CachedLM(target, V) for _ in prompts]
    seqs: list[list[int]] = [[] for _ in prompts]

    def check(feeds: list[list[int]]) -> None:
        got = b.extend(feeds)
        for r, (lm, s, f) in enumerate(zip(alone, seqs, feeds)):
            s += f
            if f:
                want = lm.extend(torch.tensor(s))
                torch.testing.assert_close(got[r], want, rtol=1e-4, atol=1e-4)

    check(prompts)
    check([[1, 2, 3], [4], [5, 6]])
    for r, keep in enumerate((len(seqs[0]) - 2, len(seqs[1]), len(seqs[2]) - 1)):  # reject some drafts
        b.rollback(r, keep)
        alone[r].rollback(keep)
        del seqs[r][keep:]
    check([[7, 8], [], [9]])
    b.keep([0, 2])
    alone, seqs = [alone[0], alone[2]], [seqs[0], seqs[2]]
    check([[10], [11, 12, 13]])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_each_sequence_decodes_as_alone(target: torch.nn.Module, temperature: float) -> None:
    """Batched, every sequence emits the tokens and accepts the drafts the batch-1 loop gives it
    with the same seed (oracle: `decode.speculative_decode`), for a model draft and prompt lookup."""
    prompts = _prompts()
    blm, lm = BatchedLM(target, V), CachedLM(target, V)

    def gens() -> list[torch.Generator | None]:
        return [None if temperature == 0 else torch.Generator().manual_seed(10 + i) for i in range(len(prompts))]

    accepted = 0
    for make in (lambda: ModelDraft("truncated:2", truncated_copy(target, 2), V), lambda: NgramDraft(V, 3)):
        k = 3
        run = batched_speculative_decode(blm, batched(make()), prompts, k, N, temperature, 1.0, gens())
        for i, (p, g) in enumerate(zip(prompts, gens())):
            alone = speculative_decode(lm, make(), p, k, N, temperature, 1.0, g)
            assert torch.equal(run.tokens[i], alone.tokens), (make().name, i)
            assert (run.accepted[i], run.drafted[i]) == (alone.accepted, alone.drafted), (make().name, i)
            accepted += sum(alone.accepted)
        assert run.passes == max(len(a) for a in run.accepted)  # the batch runs until its slowest sequence ends
    assert accepted > 0  # the comparison sees acceptances
    plain = batched_target_decode(blm, prompts, N, temperature, 1.0, gens())
    for i, (p, g) in enumerate(zip(prompts, gens())):
        assert torch.equal(plain.tokens[i], target_decode(lm, p, N, temperature, 1.0, g).tokens)


def test_loop_table(target: torch.nn.Module) -> None:
    """The table's shape, each batch size's best k the measured fastest (no speculation
    included) and every sequence as alone at temperature 0."""
    prompts = _prompts()
    lm = CachedLM(target, V)
    conts = [target_decode(lm, p, N, 0.0, 1.0, None).tokens for p in prompts]
    draft = ModelDraft("truncated:2", truncated_copy(target, 2), V)
    from infer_tool.spec.acceptance import beta
    from infer_tool.spec.sampling import warp

    acc, drafted = {}, {}
    for k in (1, 2):
        acc[k], drafted[k] = [], []
        for p, c in zip(prompts, conts):
            seq = torch.cat([p, c])
            P = len(p)
            pr = warp(lm.score(seq)[P - 1 : -1], 0.0, 1.0)
            acc[k].append(draft.round_acceptance(seq, P, k, pr, beta(pr, draft.teacher_forced(seq, P, 0.0, 1.0))))
            drafted[k].append(draft.round_drafted(seq, P, k))
    t = measure(
        target,
        V,
        [draft],
        prompts,
        ks=[1, 2],
        batch_sizes=[1, 2, 4],
        max_new_tokens=N,
        temperature=0.0,
        top_p=1.0,
        seed=0,
        continuations=conts,
        acceptance=[acc],
        drafted=[drafted],
    )
    assert [(c.batch, c.k) for c in t.cells] == [(b, k) for b in (1, 2, 4) for k in (1, 2)]
    assert all(c.as_alone is True for c in t.cells)
    # The cost model's prediction counts the target passes the loop took (T = 0: the rounds are exact).
    assert [c.predicted_passes for c in t.cells] == [c.passes for c in t.cells]
    assert all(c.predicted_speedup is not None and c.predicted_speedup > 0 for c in t.cells)
    assert set(t.cost_fits) == {"target", "truncated:2"}
    for b in (1, 2, 4):
        options = [(1.0, 0)] + [(c.speedup, c.k) for c in t.cells if c.batch == b]
        assert t.best_k["truncated:2"][b] == max(options)[1]
        assert all(c.speedup == pytest.approx(c.plain_seconds / c.seconds) for c in t.cells)
    assert t.schedule["truncated:2"] == schedule(t.best_k["truncated:2"])
    assert t.schedule["truncated:2"][0][0] == 1 and t.schedule["truncated:2"][-1][1] == 4
