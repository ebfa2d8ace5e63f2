"""The sensitivity pass of mixed precision (calib/mixed_sensitivity.py) against its reference,
the KL divergence measured directly with only one group quantized, on a tiny Llama; vLLM's
scheme units; and `quantize-plan`'s JSON contract and refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import TEXT, save_tiny_llama
from typer.testing import CliRunner

from infer_tool.calib.architectures import architecture_for
from infer_tool.calib.mixed_candidates import parse_candidates
from infer_tool.calib.mixed_sensitivity import linear_groups, measure_sensitivity, plan_weights, weights_replaced
from infer_tool.cli.app import app
from infer_tool.common.errors import BadInput
from infer_tool.evals.kld import token_kl

runner = CliRunner()
VOCAB = 96


def tiny() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8)  # a peaked next-token distribution, as trained models have
    return m


def ranks(x: list[float]) -> torch.Tensor:
    return torch.tensor(x).argsort().argsort().double()


def spearman(a: list[float], b: list[float]) -> float:
    return float(torch.corrcoef(torch.stack([ranks(a), ranks(b)]))[0, 1])


def test_groups_are_vllms_fused_linears() -> None:
    m = tiny()
    groups = linear_groups(m, architecture_for("llama"))
    assert [g.name for g in groups[:4]] == [
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.gate_up_proj",
        "model.layers.0.mlp.down_proj",
    ]
    assert groups[0].linears == tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    assert groups[0].shapes == ((64, 64), (32, 64), (32, 64))
    assert sum(len(g.linears) for g in groups) == 14


def test_moe_models_are_refused_naming_the_layer() -> None:
    from tiny_moe import make_moe

    m = make_moe("qwen3_moe")
    with pytest.raises(BadInput, match=r"model\.layers\.0 is a mixture of experts"):
        linear_groups(m, architecture_for("qwen3_moe", m.config))


@pytest.mark.slow
def test_predicted_costs_rank_and_add_up_like_the_measured_kl() -> None:
    """Reference: KL(P_fp ‖ P_quantized) measured on held-out windows with only one group
    quantized (RTN), for every (group, candidate); and with every group quantized at once."""
    m, arch = tiny(), architecture_for("llama")
    groups = linear_groups(m, arch)
    cands = parse_candidates("W4A16_G16,W4A16_G32,W8A16_G32")
    calib = torch.randint(0, VOCAB, (16, 32), generator=torch.Generator().manual_seed(1))
    sens = measure_sensitivity(m, arch, groups, cands, calib)
    held_out = torch.randint(0, VOCAB, (16, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = m(held_out).logits.reshape(-1, VOCAB)

    def measured(chosen: dict[str, Any]) -> float:
        with weights_replaced(m, arch, plan_weights(m, arch, groups, chosen)), torch.no_grad():
            return float(token_kl(ref, m(held_out).logits.reshape(-1, VOCAB)).mean())

    truth = [measured({g.name: c}) for g in groups for c in cands]
    for estimator, least in (("diagonal", 0.9), ("sampled", 0.8)):
        predicted = [v for row in sens.costs(estimator) for v in row]
        assert spearman(predicted, truth) >= least, estimator
    scaled = sens.costs("scaled")  # the diagonal's order at the sampled estimate's total
    assert sum(v for r in scaled for v in r) == pytest.approx(sum(v for r in sens.sampled for v in r), rel=1e-9)
    assert ranks([v for r in scaled for v in r]).tolist() == ranks([v for r in sens.diagonal for v in r]).tolist()
    total = measured({g.name: cands[1] for g in groups})  # every group W4A16 g32 at once
    predicted_total = sum(row[1] for row in sens.diagonal)
    assert 0.7 <= predicted_total / total <= 1.3
    with torch.no_grad():  # the weights are back
        assert torch.equal(m(held_out).logits.reshape(-1, VOCAB), ref)


def test_a_candidates_estimate_does_not_depend_on_the_others_measured_with_it() -> None:
    """The pass measures every candidate of a group in one product per linear; each column must
    be what that candidate alone gives (the same windows, the same sampled labels), and a
    candidate that does not take a group (g128 does not divide K = 64) is None there."""
    m, arch = tiny(), architecture_for("llama")
    groups = linear_groups(m, arch)
    calib = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    together = measure_sensitivity(m, arch, groups, parse_candidates("W8A16_G16,NONE,W4A16_G16,W4A16"), calib)
    for col, name in ((0, "W8A16_G16"), (2, "W4A16_G16")):
        alone = measure_sensitivity(m, arch, groups, parse_candidates(name), calib)
        for est in ("sampled", "diagonal"):
            got = [row[col] for row in getattr(together, est)]
            want = [row[0] for row in getattr(alone, est)]
            assert got == pytest.approx(want, rel=1e-4), (name, est)
    assert all(row[1] == 0.0 for row in together.diagonal)  # NONE
    assert [row[3] is None for row in together.diagonal] == [g.shapes[0][1] != 128 for g in groups]
    assert sum(row[3] is not None and row[3] > 0 for row in together.diagonal) == 2  # the down_proj of each layer


def plan_cli(tmp_path: Path, *args: str) -> Any:
    model = save_tiny_llama(tmp_path / "m")
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    base = ["quantize-plan", str(model), "--calib", str(corpus), "--num-samples", "2", "--seq-len", "16"]
    return runner.invoke(app, base + ["--candidates", "W4A16_G16,W8A16_G16,NONE", "--no-progress", *args])


@pytest.mark.slow
def test_cli_json_plans_fit_their_budgets_and_cover_every_linear(tmp_path: Path) -> None:
    r = plan_cli(tmp_path, "--target-bits", "6,7,10", "--max-kld", "1e-4", "--dtype", "bfloat16", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert [p["budget"] for p in report["plans"]] == ["6 bits", "7 bits", "10 bits", "kld <= 0.0001"]
    linears = {n for p in report["plans"] for n in p["linears"]}
    assert len(linears) == 14  # 2 layers x 7 linears, every one planned
    kld = [p["predicted_kld"] for p in report["plans"][:3]]
    assert kld[0] >= kld[1] >= kld[2]  # more bits, no more predicted damage
    for p, target in zip(report["plans"], (6, 7, 10)):
        assert p["bits"] <= target and p["bound"] <= p["predicted_kld"] + 1e-15
        assert sum(p["counts"].values()) == report["linear_groups"]
    assert report["plans"][3]["predicted_kld"] <= 1e-4
    for est in ("scaled", "diagonal", "sampled"):  # every estimates of every (group, candidate); NONE costs nothing
        costs = report["group_costs"][est]
        assert len(costs) == report["linear_groups"]
        assert all(c["NONE"] == 0.0 and c["W4A16_G16"] > 0 and c["W8A16_G16"] > 0 for c in costs.values())
    # the low-variance estimate orders 4 below 8 bits in every group (the one-sample one may not, by chance)
    assert all(c["W4A16_G16"] > c["W8A16_G16"] for c in report["group_costs"]["diagonal"].values())
    assert not any("fitted to the calibration windows" in n for n in report["notes"])


@pytest.mark.slow
def test_gptq_plans_say_their_prediction_is_fitted(tmp_path: Path) -> None:
    """GPTQ candidates are solved on the windows their costs are measured on: the report says the
    predicted KL understates held-out KL and how many windows to give."""
    r = plan_cli(tmp_path, "--target-bits", "6", "--method", "gptq", "--dtype", "bfloat16", "--json")
    assert r.exit_code == 0, r.output
    notes = [n for n in json.loads(r.stdout)["notes"] if "fitted to the calibration windows" in n]
    assert len(notes) == 1 and "--num-samples 128" in notes[0]


@pytest.mark.slow
def test_a_candidate_that_takes_only_some_groups_is_planned_where_it_fits(tmp_path: Path) -> None:
    """W4A16 (group 128) takes only the down projections (K = 128; the others have K = 64): the
    plan may put it there and nowhere else, and its uniform row is left out."""
    model = save_tiny_llama(tmp_path / "m")
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    r = runner.invoke(
        app,
        ["quantize-plan", str(model), "--calib", str(corpus), "--num-samples", "2", "--seq-len", "16"]
        + ["--candidates", "W4A16,W4A16_G16,W8A16_G16", "--target-bits", "4.9,9", "--dtype", "bfloat16"]
        + ["--no-progress", "--json"],
    )
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert [u["candidate"] for u in report["uniform"]] == ["W4A16_G16", "W8A16_G16"]
    low = report["plans"][0]  # below uniform W4A16_G16's 5 bits: g128 on the down projections is the only way
    assert low["bits"] <= 4.9
    assert {g for g, c in low["groups"].items() if c == "W4A16"} == {f"model.layers.{i}.mlp.down_proj" for i in (0, 1)}
    for p in report["plans"]:
        assert all(g.endswith("down_proj") for g, c in p["groups"].items() if c == "W4A16")


@pytest.mark.parametrize(
    "args,says",
    [
        (["--target-bits", "4.5x"], "'4.5x' is not a positive number"),
        ([], "give a budget"),
        (["--target-bits", "5", "--candidates", "W4A16,INT3"], "--candidates 'INT3' is not a preset"),
        (["--target-bits", "5", "--max-kld", "-1"], "--max-kld -1.0"),
        (["--target-bits", "5", "--estimator", "exact"], "--estimator 'exact'"),
    ],
)
def test_cli_refusals_are_one_line_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    r = runner.invoke(app, ["quantize-plan", str(tmp_path / "nowhere"), *args])
    assert r.exit_code == 2, r.output
    assert says in r.output and "Traceback" not in r.output


@pytest.mark.slow
def test_cli_table_names_each_budget_and_the_groups_off_the_common_scheme(tmp_path: Path) -> None:
    r = plan_cli(tmp_path, "--target-bits", "7", "--dtype", "bfloat16")
    assert r.exit_code == 0, r.output
    assert "uniform W4A16_G16" in r.stdout and "uniform NONE" in r.stdout
    assert "7 bits:" in r.stdout and " on " in r.stdout  # the plan's common scheme, then the others by group
    assert "predicted KL" in r.stdout
