"""Writing checkpoints one tensor at a time: the bytes are safetensors' own, the shards
and index are Hugging Face's."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer_tool.common.errors import BadInput
from infer_tool.common.sizes import parse_size
from infer_tool.packers.safetensors_stream import DTYPE_ORDER, spec_of, write_streamed
from infer_tool.packers.shards import PartFiles, in_memory, plan_shards, write_shards


def _random_tensors(rng: random.Random) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(rng.randint(1, 12)):
        dtype = rng.choice([d for d, _ in DTYPE_ORDER])
        shape = tuple(rng.randint(0, 5) for _ in range(rng.randint(0, 3)))
        t = torch.rand(shape) > 0.5 if dtype == torch.bool else (torch.randn(shape) * 10).to(dtype)
        out[f"m.{rng.randint(0, 99)}.t{i}"] = t
    return out


def test_streamed_file_is_save_file_byte_for_byte(tmp_path):
    """Every dtype safetensors stores, empty and 0-d tensors, names in any order: the
    reference is safetensors' own writer."""
    rng = random.Random(0)
    for trial in range(40):
        tensors = _random_tensors(rng)
        save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
        write_streamed(
            tmp_path / "ours.safetensors",
            [spec_of(n, t) for n, t in tensors.items()],
            tensors.__getitem__,
            {"format": "pt"},
        )
        assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes(), trial


def test_streamed_file_refuses_a_tensor_unlike_its_header(tmp_path):
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="header says"):
        write_streamed(tmp_path / "x.safetensors", [spec_of("a", t)], lambda n: torch.zeros(5))


def test_shards_follow_hugging_face_split():
    """huggingface_hub's split on the same sizes, in the same order, is the reference."""
    from huggingface_hub import split_torch_state_dict_into_shards

    rng = random.Random(1)
    for trial in range(20):
        tensors = {f"t{i:03d}": torch.zeros(rng.choice([1, 10, 50, 200, 900])) for i in range(rng.randint(1, 30))}
        limit = rng.choice([400, 1000, 3000, 10**9])
        ours = [[s.name for s in shard] for shard in plan_shards(in_memory(tensors)[0], limit)]
        split = split_torch_state_dict_into_shards(tensors, max_shard_size=limit)
        theirs = [sorted(names) for names in split.filename_to_tensors.values()]
        assert sorted(map(sorted, ours)) == sorted(theirs), trial
        assert [n for shard in ours for n in shard] == sorted(tensors) or len(ours) > 1


def test_sharded_write_reads_back_with_index(tmp_path):
    tensors = {f"layer.{i}.w": torch.randn(100, 10) for i in range(6)}  # 4000 bytes each
    files = write_shards(tmp_path, *in_memory(tensors), max_shard_bytes=9000, total_parameters=6000)
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 24000, "total_parameters": 6000}
    assert sorted(index["weight_map"]) == sorted(tensors)
    back = {}
    for f in files:
        back.update(load_file(str(tmp_path / f)))
    assert all(torch.equal(back[n], t) for n, t in tensors.items())
    parts = PartFiles(tmp_path / f for f in files)
    assert sorted(s.name for s in parts.specs()) == sorted(tensors)
    assert torch.equal(parts.load("layer.3.w"), tensors["layer.3.w"])


def test_one_shard_is_model_safetensors_without_index(tmp_path):
    tensors = {"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.int32)}
    assert write_shards(tmp_path, *in_memory(tensors), max_shard_bytes=10**9) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("5GB", 5 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5gb", 1_500_000_000),
        ("1000", 1000),
        (2048, 2048),
        ("2 GiB", 2 * 2**30),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text, "--max-shard-size") == expected


@pytest.mark.parametrize("text", ["", "5XB", "-1GB", "GB", "0"])
def test_parse_size_refuses(text):
    with pytest.raises(BadInput, match="size"):
        parse_size(text, "--max-shard-size")
