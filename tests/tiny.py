"""Tiny random-initialised models and an offline tokenizer for tests (no hub)."""

from __future__ import annotations

from pathlib import Path

TEXT = (
    "The state of the union is strong. We the people, in order to form a more perfect "
    "union, establish justice, insure domestic tranquility, provide for the common "
    "defence, promote the general welfare, and secure the blessings of liberty. "
) * 8


def make_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on TEXT, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def make_llama(vocab_size: int, seed: int = 0, layers: int = 2, hidden: int = 64, tie: bool = True):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config).eval()


def save_tiny_llama(path: Path, seed: int = 0, **kw) -> Path:
    """A tiny Llama + tokenizer saved as a local HF directory (safetensors)."""
    tok = make_tokenizer()
    model = make_llama(len(tok), seed=seed, **kw)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
