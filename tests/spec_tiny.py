"""Tiny random Llamas sharing a vocabulary, for the speculative-decoding tests, and the
fixture that runs them on one thread (they are dispatch-bound: more threads only
oversubscribe shared cores). Import `one_thread` into a test module to apply it there."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

V = 96  # the vocabulary every tiny target and draft shares


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(layers: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(cfg).eval()
