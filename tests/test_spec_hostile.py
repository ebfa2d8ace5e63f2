"""spec-profile's hostile inputs (issue 58): numbers in flags and draft specs are ASCII digits,
and a target or draft whose outputs are NaN / inf is refused (exit 2, naming the model and the
prompt and pass where it showed), never profiled into an exit 0 with a made-up acceptance.

Through the real entry point (`infer_tool.cli.app.main`): exit 2, one line on stderr naming
the bad value.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from infer_tool.cli.app import main
from infer_tool.common.errors import BadInput
from infer_tool.jobs.spec_profile import parse_ks
from infer_tool.spec.ascii_numbers import ascii_float, ascii_int
from infer_tool.spec.inputs import parse_draft
from infer_tool.spec.report import parse_spec

V = 64


def save_tiny(directory: Path, seed: int, nan_in: str | None = None) -> Path:
    """A 3-layer Llama over a word-level vocabulary w0..w62; `nan_in`: a parameter name
    whose weights are set to NaN (a broken checkpoint)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["[UNK]"] + [f"w{i}" for i in range(V - 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(directory)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg)
    if nan_in is not None:
        with torch.no_grad():
            dict(model.named_parameters())[nan_in].fill_(float("nan"))
    model.save_pretrained(directory)
    return directory


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    captured = capsys.readouterr()
    return int(e.value.code), captured.out, captured.err


@pytest.mark.parametrize(
    "spec",
    ["truncated:²", "truncated:١٢", "truncated:1_0", "truncated:-1", "ngram:٣", "ngram:1_0", "prompt-lookup:²"],
)
def test_draft_numbers_are_ascii(spec: str) -> None:
    with pytest.raises(BadInput, match="ASCII digits") as e:
        parse_draft(spec)
    assert repr(spec) in str(e.value)


def test_draft_numbers_accepted() -> None:
    assert parse_draft("truncated:20").n == 20
    assert parse_draft("ngram:4").n == 4
    assert parse_draft("ngram").n == 3


@pytest.mark.parametrize("text", ["١-٣", "1_0", "²", "1-٣", "3,x"])
def test_k_digits_are_ascii(text: str) -> None:
    with pytest.raises(BadInput, match="--k"):
        parse_ks(text)


def test_number_parsers() -> None:
    assert ascii_int(" 12 ") == 12 and ascii_int("١٢") is None and ascii_int("1_0") is None
    assert ascii_int("-3") is None and ascii_int("-3", signed=True) == -3
    assert ascii_float("0.7") == 0.7 and ascii_float("1e-3") == 1e-3 and ascii_float(".5") == 0.5
    for bad in ("nan", "inf", "-inf", "1e999", "١٫٥", "1_0.5", "0x10", ""):
        assert ascii_float(bad) is None, bad


@pytest.mark.parametrize("text", ["nan,4,0.05", "0.8,٤,0.05", "0.8,4,inf", "1.5,4,0.05", "0.8,0,0.05", "0.8,4,-1"])
def test_kv_budget_spec_text(text: str) -> None:
    """kv-budget --spec ALPHA,K,C (read in spec/report.py): ASCII, finite, in range."""
    with pytest.raises(BadInput, match="--spec"):
        parse_spec(text)


def test_spec_report_with_nan_alpha(tmp_path: Path) -> None:
    from infer_tool.spec.report import from_report

    path = tmp_path / "r.json"
    path.write_text(
        json.dumps(
            {
                "ranking": [{"name": "d"}],
                "drafts": [{"name": "d", "alpha": float("nan"), "best_k": 3, "cost_ratio": 0.1}],
            }
        )
    )
    with pytest.raises(BadInput, match="alpha"):
        from_report(path)


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--num-prompts", "١٢"),
        ("--prompt-len", "1_0"),
        ("--max-new-tokens", "²"),
        ("--seed", "1_0"),
        ("--threads", "٢"),
        ("--temperature", "nan"),
        ("--temperature", "١٫٥"),
        ("--temperature", "inf"),
        ("--cost-ratio", "inf"),
        ("--top-p", "inf"),
        ("--cost-ratio", "nan"),
        ("--mfu", "nan"),
        ("--hbm-efficiency", "1e999"),
        ("--device", "cuda:²"),
        ("--device", "cuda:١"),
    ],
)
def test_cli_numbers_are_ascii(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["spec-profile", "--target", "smollm2-135m", "--draft", "ngram", flag, value], capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and flag in err and repr(value) in err and "ASCII" in err, err


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nan")
    prompts = root / "prompts.txt"
    prompts.write_text("w1 w2 w3 w4 w1 w2 w3\nw9 w8 w7 w9 w8\n")
    return {
        "good": save_tiny(root / "good", 0),
        "draft": save_tiny(root / "draft", 1),
        "nan_head": save_tiny(root / "nan_head", 0, nan_in="model.norm.weight"),
        "nan_draft": save_tiny(root / "nan_draft", 1, nan_in="model.layers.1.mlp.down_proj.weight"),
        "prompts": prompts,
    }


def _profile(target: Path, draft: str, prompts: Path, *extra: str) -> list[str]:
    return [
        "spec-profile",
        "--target",
        str(target),
        "--draft",
        draft,
        "--prompts",
        str(prompts),
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "6",
        "--k",
        "1-2",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--no-progress",
        "--json",
        *extra,
    ]


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_nan_target_is_refused(models: dict[str, Path], temperature: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(_profile(models["nan_head"], "ngram", models["prompts"], "--temperature", temperature), capsys)
    assert code == 2, err
    assert out == ""
    assert err.count("\n") == 1
    assert "non-finite logits" in err and "target" in err and "prompt 1 of 2" in err and "position" in err, err


@pytest.mark.parametrize("loop", [True, False])
def test_nan_draft_is_refused(models: dict[str, Path], loop: bool, capsys: pytest.CaptureFixture[str]) -> None:
    extra = () if loop else ("--no-loop",)
    code, out, err = run(_profile(models["good"], str(models["nan_draft"]), models["prompts"], *extra), capsys)
    assert code == 2, err
    assert out == ""
    assert err.count("\n") == 1
    assert f"draft {models['nan_draft']}" in err and "non-finite logits" in err and "prompt 1 of 2" in err, err


def test_finite_models_still_profile(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The guard refuses only non-finite outputs: the same command on good models exits 0."""
    code, out, err = run(_profile(models["good"], str(models["draft"]), models["prompts"]), capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert 0.0 <= doc["drafts"][0]["alpha"] <= 1.0
