"""Hostile inputs to `kv-budget` (issue 58): every config number is checked where it is
read, JSON is bounded before it is parsed, flags that constrain the answer are honoured,
and every refusal is one line, exit 2, naming the field or flag and the value."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infer_tool.cli.app import app

runner = CliRunner()
BASE = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "hidden_size": 64,
    "intermediate_size": 128,
    "vocab_size": 100,
    "max_position_embeddings": 4096,
}


def run(*args: str):
    return runner.invoke(app, ["kv-budget", *args])


def refused(r, *words: str) -> None:
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.output, r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.mark.parametrize(
    "field, raw, shown",
    [
        ("max_position_embeddings", "NaN", "nan"),
        ("max_position_embeddings", "-5", "-5"),
        ("max_position_embeddings", '"4096"', "'4096'"),
        ("max_position_embeddings", "1e308", "1e+308"),
        ("max_position_embeddings", "100000000000000000000", "100000000000000000000"),
        ("max_position_embeddings", "Infinity", "inf"),
        ("num_hidden_layers", "1000000000000", "1000000000000"),
        ("num_hidden_layers", "2.0", "2.0"),
        ("num_hidden_layers", "true", "True"),
        ("num_attention_heads", "0", "0"),
        ("hidden_size", "[64]", "[64]"),
        ("vocab_size", "-1", "-1"),
        ("intermediate_size", "1e12", "1000000000000.0"),
        ("num_key_value_heads", "{}", "{}"),
    ],
)
def test_config_number_refused_naming_field_and_value(tmp_path, field, raw, shown):
    text = json.dumps({k: v for k, v in BASE.items() if k != field})[:-1] + f', "{field}": {raw}}}'
    (tmp_path / "config.json").write_text(text)
    refused(run(str(tmp_path), "--context", "1k"), f"'{field}'", shown)


def test_a_valid_config_is_answered(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    r = run(str(tmp_path), "--context", "1k", "--concurrency", "1", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["kv_bytes_per_token"] == 2 * 2 * 4 * 16 * 2  # layers x K,V x heads x dim x bf16


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"layer_types": [[1], [2]]}, ["layer_types"]),
        ({"layer_types": "full_attention"}, ["layer_types"]),
        ({"architectures": 5, "model_type": "nemotron_h"}, []),  # not a list: read as one name
        ({"model_type": "qwen2_moe", "num_experts": 4, "mlp_only_layers": 3}, ["mlp_only_layers"]),
        ({"model_type": "jamba", "mamba_dt_rank": "big", "attn_layer_period": 2, "attn_layer_offset": 1}, ["mamba"]),
    ],
)
def test_config_structures_of_the_wrong_type(tmp_path, extra, words):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **extra}))
    r = run(str(tmp_path), "--context", "1k", "--concurrency", "1")
    if words:
        refused(r, *words)
    else:
        assert r.exit_code in (0, 2) and "Traceback" not in r.output and "internal error" not in r.output


def test_deeply_nested_json_refused_before_parsing(tmp_path):
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    refused(run(str(tmp_path)), "nests deeper than 64")
    # nesting inside strings does not count; 60 real levels are accepted by the bound
    from infer_tool.sizing.json_file import nesting_depth_exceeds

    assert not nesting_depth_exceeds('{"a": "' + "[" * 500 + '"}')
    assert not nesting_depth_exceeds("[" * 60 + "]" * 60)
    assert nesting_depth_exceeds("[" * 65 + "]" * 65)
    assert nesting_depth_exceeds('{"a":' * 70 + "1" + "}" * 70)


def test_huge_config_file_refused_by_size(tmp_path, monkeypatch):
    from infer_tool.sizing import json_file

    monkeypatch.setattr(json_file, "MAX_BYTES", 1000)
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "pad": "x" * 2000}))
    refused(run(str(tmp_path)), "too large", "1,000")


def test_max_num_seqs_caps_what_fits():
    r = run("llama-3.1-8b", "--context", "4k", "--concurrency", "64", "--max-num-seqs", "1", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    row = doc["rows"][0]
    assert not row["fits"] and row["binding"] == "max-num-seqs"
    assert doc["max_concurrency"]["4096"] == 1
    assert doc["max_context_limited_by"]["64"] == "max-num-seqs"
    assert any("--max-num-seqs 64" in n for n in doc["notes"])
    # with room for 64 sequences it fits; two replicas split the sequences
    ok = json.loads(
        run("llama-3.1-8b", "--context", "4k", "--concurrency", "64", "--max-num-seqs", "64", "--json").stdout
    )
    assert ok["rows"][0]["fits"]
    dp = run(
        "llama-3.1-8b",
        "--context",
        "4k",
        "--concurrency",
        "64",
        "--max-num-seqs",
        "32",
        "--num-gpus",
        "2",
        "--tp",
        "1",
        "--json",
    )
    assert json.loads(dp.stdout)["rows"][0]["fits"]
    plain = run(
        "llama-3.1-8b",
        "--context",
        "4k",
        "--concurrency",
        "64",
        "--max-num-seqs",
        "1",
        "--accounting",
        "plain",
        "--json",
    )
    assert json.loads(plain.stdout)["rows"][0]["binding"] == "max-num-seqs"


def test_kv_cache_memory_larger_than_the_gpu_is_refused_naming_both():
    r = run("llama-3.1-8b", "--kv-cache-memory", "500TiB")
    refused(r, "--kv-cache-memory 500 TiB", "549,755,813,888,000 bytes", "79.22 GiB", "85,061,827,297")
    assert "int4" not in r.output and "weights" not in r.stderr.split(";")[0]


@pytest.mark.parametrize(
    "flag, value, words",
    [
        ("--gpu-mem", "80", ["--gpu-mem '80'", "80GiB"]),
        ("--kv-cache-memory", "12 parsecs", ["--kv-cache-memory '12 parsecs'", "20GiB"]),
        ("--reserve", "1e9G", ["--reserve '1e9G'"]),
        ("--weights-memory", "²GiB", ["--weights-memory '²GiB'"]),
        ("--gpu-mem", "99999999TiB", ["--gpu-mem '99999999TiB'", "too large"]),
    ],
)
def test_size_flags_name_what_was_typed(flag, value, words):
    refused(run("llama-3.1-8b", flag, value), *words)
