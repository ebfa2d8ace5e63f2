"""The `suffix` draft (suffix decoding through arctic-inference, as vLLM 0.32 runs it): its
spec, the one-line refusal without the package, its proposals against the package driven the
way vLLM's `SuffixDecodingProposer` drives it, and the loop it runs in."""

from __future__ import annotations

import sys

import pytest
import torch
from spec_tiny import V, one_thread, tiny  # noqa: F401 - one_thread applies to this module

from infer_tool.common.errors import BadInput
from infer_tool.spec.inputs import parse_draft
from infer_tool.spec.vllm_engine import vllm_draft


def test_suffix_spec_and_vllm_config() -> None:
    s = parse_draft("suffix")
    assert s.kind == "suffix"
    assert dict(s.params) == {"max_tree_depth": 24, "max_spec_factor": 1.0, "min_token_prob": 0.1}  # vLLM's
    s = parse_draft("suffix:max_tree_depth=32,min_token_prob=0.25")
    assert dict(s.params) == {"max_tree_depth": 32, "max_spec_factor": 1.0, "min_token_prob": 0.25}
    assert vllm_draft(s, None, None, None).config == {  # type: ignore[arg-type]
        "method": "suffix",
        "suffix_decoding_max_tree_depth": 32,
        "suffix_decoding_max_spec_factor": 1.0,
        "suffix_decoding_min_token_prob": 0.25,
        "suffix_decoding_max_cached_requests": 0,
    }


@pytest.mark.parametrize(
    "spec",
    [
        "suffix:depth=3",
        "suffix:max_tree_depth",
        "suffix:max_tree_depth=0",
        "suffix:max_tree_depth=²",
        "suffix:max_tree_depth=2.5",
        "suffix:min_token_prob=1.5",
        "suffix:min_token_prob=nan",
        "suffix:max_spec_factor=-1",
    ],
)
def test_bad_suffix_spec(spec: str) -> None:
    with pytest.raises(BadInput) as e:
        parse_draft(spec)
    msg = str(e.value)
    assert "\n" not in msg and repr(spec) in msg and "max_tree_depth" in msg


def test_refused_in_one_line_without_arctic_inference(monkeypatch: pytest.MonkeyPatch) -> None:
    from infer_tool.spec.drafts import SuffixDraft

    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)  # import raises ImportError
    with pytest.raises(BadInput) as e:
        SuffixDraft(V)
    msg = str(e.value)
    assert "\n" not in msg and "pip install arctic-inference==0.1.1" in msg


def _vllm_way(seq: list[int], prompt_len: int, k: int, depth: int = 24) -> list[list[int]]:
    """Proposals after each generated token, driving arctic-inference as vLLM 0.32's
    `SuffixDecodingProposer.propose` does: start_request(prompt), then add_active_response
    with each new token, speculate on the last max_tree_depth tokens."""
    import numpy as np
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=0)
    cache.start_request("r", np.asarray(seq[:prompt_len], dtype=np.int32))
    out = []
    for t in range(prompt_len, len(seq)):
        cache.add_active_response("r", [seq[t]])
        pattern = np.asarray(seq[max(0, t + 1 - depth) : t + 1], dtype=np.int32)
        d = cache.speculate("r", pattern, max_spec_tokens=k, max_spec_factor=1.0, min_token_prob=0.1)
        out.append(list(d.token_ids))
    return out


def test_proposals_are_vllms() -> None:
    import arctic_inference.suffix_decoding  # noqa: F401  (make suffix installs it; make test runs it)

    from infer_tool.spec.drafts import SuffixDraft

    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, V, (7,), generator=g).tolist()
    seq = base * 3 + torch.randint(0, V, (5,), generator=g).tolist() + base
    P, k = 9, 4
    d = SuffixDraft(V)
    mine = [d.lookup(seq[: t + 1], k) for t in range(P, len(seq))]
    assert mine == _vllm_way(seq, P, k)
    assert sum(map(len, mine)) > 10  # the comparison sees proposals
    d.lookup(seq[:5] + [1, 2], k)  # a sequence that diverges rebuilds the tree
    assert d.lookup(seq[:20], k) == SuffixDraft(V).lookup(seq[:20], k)


def test_loop_is_lossless_and_replayed_by_teacher_forcing() -> None:
    """At temperature 0 the loop with the suffix draft emits the target's greedy tokens, and
    the rounds replayed from teacher-forced acceptance are the loop's own."""
    import arctic_inference.suffix_decoding  # noqa: F401  (make suffix installs it; make test runs it)

    from infer_tool.spec.acceptance import beta
    from infer_tool.spec.cached_lm import CachedLM
    from infer_tool.spec.decode import speculative_decode, target_decode
    from infer_tool.spec.drafts import SuffixDraft
    from infer_tool.spec.predict import greedy_rounds
    from infer_tool.spec.sampling import warp

    target = tiny(4, 0)
    lm = CachedLM(target, V)
    g = torch.Generator().manual_seed(7)
    base = torch.randint(0, V, (6,), generator=g)
    prompt = torch.cat([base, base, base[:3]])
    new, k = 24, 3
    cont = target_decode(lm, prompt, new, 0.0, 1.0, None).tokens
    draft = SuffixDraft(V)
    run = speculative_decode(lm, draft, prompt, k, new, 0.0, 1.0, None)
    assert torch.equal(run.tokens, cont)
    seq = torch.cat([prompt, cont])
    P = len(prompt)
    p = warp(lm.score(seq)[P - 1 : -1], 0.0, 1.0)
    acc = draft.round_acceptance(seq, P, k, p, beta(p, draft.teacher_forced(seq, P, 0.0, 1.0)))
    assert greedy_rounds(acc, k) == (run.accepted, run.drafted)
    assert sum(run.drafted) > 0
