"""Incomplete configs (issue 60): a field config.json omits takes the model's own config
class default, read from transformers' source without importing it (or from the table
`sizing/class_defaults.json`); both are checked here against the classes themselves. A
term nothing can default is left unknown with a note, and the KV answer still comes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from infer_tool.cli.app import app
from infer_tool.sizing import class_defaults as cd
from infer_tool.sizing.hf_config import shape_from_config
from infer_tool.sizing.presets import find_model_preset

runner = CliRunner()
TABLE = json.loads(cd.TABLE.read_text())


def _declared(model_type: str) -> dict:
    """The oracle: the defaults the transformers class itself declares."""
    sys.path.insert(0, "benchmarks")
    try:
        from kv_class_defaults import config_class, declared_defaults
    finally:
        sys.path.pop(0)
    cls = config_class(model_type)
    assert cls is not None, model_type
    return declared_defaults(cls)


@pytest.mark.parametrize("model_type", sorted(TABLE["classes"]))
def test_table_and_source_reader_match_the_transformers_class(model_type):
    import transformers

    declared = _declared(model_type)
    where, from_source = cd.from_transformers(model_type)
    assert from_source == declared, where  # the source reader, against whatever transformers is installed
    assert TABLE["classes"][model_type]["class"] in where
    if transformers.__version__ == TABLE["transformers"]:  # the table holds the release it was written from
        assert TABLE["classes"][model_type]["defaults"] == declared
    else:  # another release: the table still names size fields that class declares
        assert set(TABLE["classes"][model_type]["defaults"]) & set(declared)


def test_table_is_used_without_transformers(monkeypatch):
    monkeypatch.setattr(cd, "_transformers_dir", lambda: None)
    cd.from_transformers.cache_clear()
    try:
        where, defaults = cd.class_defaults("qwen3")
        assert "table" in where and defaults["head_dim"] == 128
        assert cd.class_defaults("no_such_family") == ("", {})
    finally:
        cd.from_transformers.cache_clear()


def test_source_reader_evaluates_only_literals():
    src = (
        "class A(PreTrainedConfig):\n"
        "    model_type = 'a'\n"
        "    max_position_embeddings: int = 4096 * 32\n"
        "    head_dim: int = open('x').read()\n"
        "    vocab_size: int = 2 ** 100000\n"
        "class B:\n"
        "    model_type = 'b'\n"
        "    def __init__(self, hidden_size=-64, num_hidden_layers=2, *, sliding_window=None):\n"
        "        pass\n"
    )
    assert cd.parse_config_source(src, "a") == ("A", {"max_position_embeddings": 131072})
    assert cd.parse_config_source(src, "b") == (
        "B",
        {"hidden_size": -64, "num_hidden_layers": 2, "sliding_window": None},
    )
    assert cd.parse_config_source("def (", "a") is None


def _preset(key: str, drop: str) -> dict:
    cfg = dict(find_model_preset(key).config)
    del cfg[drop]
    return cfg


def test_qwen3_without_head_dim_takes_qwen3configs_128():
    # hidden / heads would be 5120 / 64 = 80: 163,840 B/token; Qwen3Config says 128
    shape = shape_from_config(_preset("qwen3-32b", "head_dim"), "q")
    assert sum(l.kv_heads * (l.head_dim + l.v_head_dim) * 2 for l in shape.layers) == 262_144
    assert any("Qwen3Config" in n and "head_dim 128" in n for n in shape.notes)


def test_mixtral_without_experts_per_token_takes_two():
    full = shape_from_config(dict(find_model_preset("mixtral-8x7b").config), "m")
    cut = shape_from_config(_preset("mixtral-8x7b", "num_experts_per_tok"), "m")
    assert cut.params.active == full.params.active
    assert cut.params.active / 1e9 == pytest.approx(12.9, abs=0.1)  # Mistral AI: 12.9B active of 46.7B
    assert cut.forward.experts_per_token == 2


def test_explicit_null_is_not_defaulted():
    # MistralConfig's class default window is 4096; a config saying null has none
    cfg = {
        "model_type": "mistral",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "hidden_size": 64,
        "intermediate_size": 128,
        "vocab_size": 100,
        "sliding_window": None,
    }
    assert {l.kind for l in shape_from_config(cfg, "m").layers} == {"full_attention"}
    cfg.pop("sliding_window")
    assert {l.kind for l in shape_from_config(cfg, "m").layers} == {"sliding_attention"}


def test_unknown_moe_without_top_k_is_answered_with_unknown_terms(tmp_path):
    cfg = {
        "model_type": "mystery_moe",
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 512,
        "moe_intermediate_size": 256,
        "vocab_size": 1000,
        "num_local_experts": 8,
        "max_position_embeddings": 8192,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = runner.invoke(
        app, ["kv-budget", str(tmp_path), "--gpu", "L4", "--context", "8k", "--concurrency", "1", "--json"]
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["kv_bytes_per_token"] == 4 * 2 * 2 * 64 * 2
    stage = doc["memory"]["stages"][0]
    assert stage["activation_peak_bytes"] is None and "num_experts_per_tok" in stage["activation_peak_at"]
    assert any("num_experts_per_tok" in n and "--reserve" in n for n in doc["notes"])
    assert any("upper bound" in n for n in doc["notes"])
    assert doc["rows"][0]["speed"] is None  # active parameters unknown: no speed is made up
    human = runner.invoke(app, ["kv-budget", str(tmp_path), "--gpu", "L4", "--context", "8k", "--concurrency", "1"])
    assert human.exit_code == 0 and "unknown" in human.stdout
    # with the field the activation term is modelled
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 2}))
    r = runner.invoke(app, ["kv-budget", str(tmp_path), "--gpu", "L4", "--context", "8k", "--json"])
    assert json.loads(r.stdout)["memory"]["stages"][0]["activation_peak_bytes"] > 0


def test_weights_unknown_still_answers_the_kv(tmp_path):
    cfg = {"model_type": "mystery", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = runner.invoke(
        app, ["kv-budget", str(tmp_path), "--gpu", "L4", "--context", "4k", "--concurrency", "1", "--json"]
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["kv_bytes_per_token"] == 2 * 2 * 4 * 16 * 2
    assert doc["weights"]["how"].startswith("unknown") and "--weights-memory" in doc["weights"]["how"]
    assert doc["memory"]["stages"][0]["weights_bytes"] is None


def test_defaults_never_import_torch_or_transformers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_preset("qwen3-32b", "head_dim")))
    code = (
        "import sys; from infer_tool.cli.app import app\n"
        "try:\n    app(['kv-budget', sys.argv[1], '--context', '4k', '--json'])\n"
        "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"kv_bytes_per_token": 262144' in r.stdout
