"""Activations kept in a file (`calib/spill.py`): the bytes read back are the bytes written,
the file disappears with the store, and GPTQ with its replayed outputs spilled gives the
same checkpoint tensors as with them in memory."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from test_pipeline import ids, tiny_model

from infer_tool.calib.pipeline import quantize_model
from infer_tool.calib.spill import SpilledChunks, chunk_store, drain
from infer_tool.schemes.registry import make_scheme


def test_round_trip_every_dtype_and_shape(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    chunks = [
        torch.randn(3, 7, 5, generator=g),
        torch.randn(2, 4, generator=g).to(torch.bfloat16),
        torch.randint(-5, 5, (11,), generator=g),
        torch.randn(4, 6, generator=g).t(),  # not contiguous
        torch.empty(0, 3),
        torch.tensor([float("nan"), float("inf"), -0.0]),
    ]
    store = SpilledChunks(tmp_path)
    for c in chunks:
        store.append(c)
    assert os.listdir(tmp_path) == []  # unlinked at once: nothing to clean up after a kill
    assert len(store) == len(chunks)
    assert store.nbytes == sum(c.numel() * c.element_size() for c in chunks)
    for _ in range(2):  # read back twice, in order and at random
        for c, r in zip(chunks, store):
            assert r.dtype == c.dtype and r.shape == c.shape
            assert torch.equal(
                r.view(torch.uint8) if r.numel() else r, c.contiguous().view(torch.uint8) if c.numel() else c
            )
    assert torch.equal(store[3], chunks[3])
    store.close()


def test_drain_frees_as_it_goes(tmp_path) -> None:
    chunks = [torch.full((2,), float(i)) for i in range(4)]
    listed = list(chunks)
    seen = []
    for x in drain(listed):
        seen.append(x)
        assert len(listed) == 4 - len(seen)  # a list is emptied as it is read
    assert [float(x[0]) for x in seen] == [0.0, 1.0, 2.0, 3.0]
    store = chunk_store(tmp_path, torch.device("cpu"))
    for c in chunks:
        store.append(c)
    assert [float(x[0]) for x in drain(store)] == [0.0, 1.0, 2.0, 3.0]
    assert store._fd is None  # closed at the end
    assert chunk_store(None, torch.device("cpu")) == []
    assert chunk_store(tmp_path, torch.device("meta")) == []  # only CPU tensors go to a file


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_gptq_spilled_equals_in_memory(model_type: str, tmp_path, monkeypatch) -> None:
    model, x = tiny_model(model_type), ids()
    scheme = make_scheme("gptq", group_size=32, act_order=True)
    a = quantize_model(copy.deepcopy(model), x, scheme, device="cpu", batch_size=2)
    written = []
    append = SpilledChunks.append
    monkeypatch.setattr(SpilledChunks, "append", lambda self, t: (written.append(t.numel()), append(self, t))[1])
    b = quantize_model(copy.deepcopy(model), x, scheme, device="cpu", batch_size=2, spill=tmp_path)
    layers, chunks = model.config.num_hidden_layers, -(-x.shape[0] // 2)
    assert len(written) == layers * 4 * chunks  # o_proj's and down_proj's inputs and outputs, every chunk
    assert a.quantized.keys() == b.quantized.keys() and a.quantized
    for n in a.quantized:
        assert torch.equal(a.quantized[n].q, b.quantized[n].q), n
        assert torch.equal(a.quantized[n].scale, b.quantized[n].scale), n
    assert [e.relative_output_error for e in a.layer_errors] == [e.relative_output_error for e in b.layer_errors]
    assert os.listdir(tmp_path) == []
