"""`infer-tool spec-profile` end to end on tiny saved models with a word-level tokenizer."""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from infer_tool.cli.app import app

V = 64
runner = CliRunner()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def save_tiny(directory: Path, seed: int, prefix: str = "w") -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["[UNK]"] + [f"{prefix}{i}" for i in range(V - 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(directory)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=V, max_position_embeddings=128,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    LlamaForCausalLM(cfg).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    prompts = root / "prompts.txt"
    prompts.write_text("w1 w2 w3 w4 w1 w2 w3\n\nw9 w8 w7 w9 w8\nw5 w5 w6 w5 w5 w6 w5\n")
    empty = root / "empty.txt"
    empty.write_text("\n  \n")
    return {
        "target": save_tiny(root / "target", 0),
        "draft": save_tiny(root / "draft", 1),
        "alien": save_tiny(root / "alien", 1, prefix="x"),
        "prompts": prompts,
        "empty": empty,
    }


def run(*args: str):
    return runner.invoke(app, ["spec-profile", "--device", "cpu", "--no-progress", *args])


def test_json_contract(files) -> None:
    res = run(
        "--target", str(files["target"]), "--draft", "truncated:1", "--draft", "ngram",
        "--draft", str(files["draft"]), "--prompts", str(files["prompts"]), "--num-prompts", "3",
        "--max-new-tokens", "8", "--k", "1-2", "--json",
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["target"] == str(files["target"])
    assert [d["name"] for d in report["drafts"]] == ["truncated:1", "ngram:3", str(files["draft"])]
    for d in report["drafts"]:
        assert {"name", "alpha", "alpha_ci", "cost_ratio", "per_k", "best_k"} <= set(d)
        assert d["alpha_ci"][0] <= d["alpha"] <= d["alpha_ci"][1]
        assert [r["k"] for r in d["per_k"]] == [1, 2]
        for r in d["per_k"]:
            assert {"k", "expected_tokens", "measured_tokens", "predicted_speedup", "measured_speedup"} <= set(r)
            assert r["greedy_identical"] is True
        assert d["best_k"] in (1, 2) and d["cost_ratio_source"] == "measured"
    assert [r["rank"] for r in report["ranking"]] == [1, 2, 3]
    assert report["settings"]["num_prompts"] == 3


def test_cost_ratio_override_and_table(files) -> None:
    res = run(
        "--target", str(files["target"]), "--draft", "truncated:2", "--prompts", str(files["prompts"]),
        "--num-prompts", "2", "--max-new-tokens", "6", "--k", "1,3", "--cost-ratio", "0.5", "--json",
    )
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)["drafts"][0]
    assert d["cost_ratio"] == 0.5 and d["cost_ratio_source"] == "given"
    a = d["alpha"]
    for r in d["per_k"]:
        k = r["k"]
        expected = sum(a**i for i in range(k + 1)) / (0.5 * k + 1)
        assert r["predicted_speedup"] == pytest.approx(expected)
    res = run(
        "--target", str(files["target"]), "--draft", "prompt-lookup:2", "--prompts", str(files["prompts"]),
        "--num-prompts", "2", "--max-new-tokens", "6", "--k", "2",
    )
    assert res.exit_code == 0, res.output
    assert "prompt-lookup:2" in res.stdout and "accepted drafted tokens per target pass" in res.stdout
    assert "ranking:" in res.stdout


@pytest.mark.parametrize(
    "target,draft,prompts,extra,needle",
    [
        ("target", "truncated:1", "prompts", ["--k", "0"], "--k"),
        ("target", "truncated:1", "prompts", ["--k", "a-b"], "--k"),
        ("./no-such-model", "ngram", "prompts", [], "does not exist"),
        ("target", "./no-such-draft", "prompts", [], "does not exist"),
        ("target", "truncated:1", "empty", [], "empty"),
        ("target", "alien", "prompts", [], "does not share the target's vocabulary"),
        ("target", "truncated:3", "prompts", [], "truncated:N"),
        ("target", "ngram:0", "prompts", [], "ngram:N"),
    ],
)
def test_bad_input_exits_2(files, target, draft, prompts, extra, needle) -> None:
    def path(name: str) -> str:
        return str(files[name]) if name in files else name

    res = run("--target", path(target), "--draft", path(draft), "--prompts", path(prompts),
              "--max-new-tokens", "4", *extra)
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert "Traceback" not in res.output
