"""Tuned launch configs (`kernels/tuning.py`): keys, buckets, the per-GPU JSON table, and
the launchers' use of it (as-is when present, their heuristics when absent). No GPU:
the GPU name is stood in for where a test needs one."""

import json

import pytest
import torch

from infer_tool.kernels import fp8, tuning, w4a16
from infer_tool.kernels.layout import pack_int4_k


@pytest.fixture(autouse=True)
def fresh_cache():
    tuning.load_table.cache_clear()
    yield
    tuning.load_table.cache_clear()


def test_m_buckets():
    assert [tuning.m_bucket(m) for m in (1, 2, 3, 4, 5, 16, 17, 64, 65, 2048, 2049, 9000)] == [
        1, 2, 4, 4, 8, 16, 32, 64, 128, 2048, 4096, 4096,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="M must be >= 1"):
        tuning.m_bucket(0)


def test_key_and_gpu_file_name():
    assert tuning.key("w4a16", 3, 14336, 4096, 128) == "w4a16|m4|n14336|k4096|g128"
    assert tuning.key("fp8-w8a8", 2048, 4096, 14336) == "fp8-w8a8|m2048|n4096|k14336|g0"
    assert tuning.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    with pytest.raises(ValueError, match="gives no file name"):
        tuning.gpu_slug("ℍ")


def test_absent_table_is_empty_and_cpu_never_looks(tmp_path):
    assert tuning.load_table("NVIDIA H200", tmp_path) == {}
    assert tuning.lookup(torch.device("cpu"), "w4a16", 1, 64, 64, 128) is None


def test_write_then_read_merges(tmp_path):
    tuning.write_table("NVIDIA H200", {"a|m1|n1|k1|g0": {"BLOCK_N": 64}}, tmp_path)
    tuning.write_table("NVIDIA H200", {"b|m1|n1|k1|g0": {"BLOCK_N": 128}}, tmp_path)
    doc = json.loads((tmp_path / "nvidia_h200.json").read_text())
    assert doc["gpu"] == "NVIDIA H200" and set(doc["configs"]) == {"a|m1|n1|k1|g0", "b|m1|n1|k1|g0"}
    assert tuning.load_table("NVIDIA H200", tmp_path)["b|m1|n1|k1|g0"] == {"BLOCK_N": 128}


def test_refuses_another_gpus_table(tmp_path):
    (tmp_path / "nvidia_h200.json").write_text(json.dumps({"gpu": "NVIDIA H100", "configs": {}}))
    with pytest.raises(ValueError, match="holds configs of 'NVIDIA H100'"):
        tuning.load_table("NVIDIA H200", tmp_path)


def test_config_space_starts_with_the_default_and_is_unique():
    default = {"path": "gemv", "BLOCK_M": 1, "BLOCK_N": 128, "SPLIT_K": 4, "num_warps": 4, "num_stages": 2}
    space = tuning.config_space("w4a16", "gemv", 1, default)
    assert space[0] == default and len(space) == len({json.dumps(c, sort_keys=True) for c in space}) > 10
    assert {c["SPLIT_K"] for c in space} == {2, 4, 8}
    with pytest.raises(ValueError, match="unknown kernel path"):
        tuning.config_space("w4a16", "warp", 1, default)


def _pretend_gpu(monkeypatch, tmp_path, name="Test GPU"):
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(tuning, "_gpu_name", lambda device: name)


def test_w4a16_uses_a_tuned_config_as_is_and_falls_back_without_one(monkeypatch, tmp_path):
    _pretend_gpu(monkeypatch, tmp_path)
    K, N = 256, 96
    x = torch.zeros(1, K, dtype=torch.float16)
    qw = pack_int4_k(torch.zeros(K, N, dtype=torch.uint8))
    s = torch.ones(2, N, dtype=torch.float16)
    launch, _ = w4a16.plan(x, qw, s, None, None, 128)
    assert launch.meta["BLOCK_N"] == 128  # no table: the heuristic
    tuned = {"path": "gemv", "BLOCK_M": 1, "BLOCK_N": 32, "SPLIT_K": 2, "num_warps": 2, "num_stages": 1}
    tuning.write_table("Test GPU", {tuning.key("w4a16", 1, N, K, 128): tuned}, tmp_path)
    launch, _ = w4a16.plan(x, qw, s, None, None, 128)
    assert (launch.meta["BLOCK_N"], launch.meta["SPLIT_K"], launch.meta["num_warps"]) == (32, 2, 2)
    launch, _ = w4a16.plan(torch.zeros(16, K, dtype=torch.float16), qw, s, None, None, 128)
    assert launch.meta["BLOCK_M"] == 16  # another M bucket: not in the table, heuristic


def test_a_tuned_entry_with_unknown_fields_is_refused(monkeypatch, tmp_path):
    _pretend_gpu(monkeypatch, tmp_path)
    tuning.write_table("Test GPU", {tuning.key("w4a16", 1, 8, 128, 128): {"path": "gemv", "BLOCK_Q": 1}}, tmp_path)
    x = torch.zeros(1, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="unknown fields"):
        w4a16.plan(x, pack_int4_k(torch.zeros(128, 8, dtype=torch.uint8)), torch.ones(1, 8).half(), None, None, 128)


def test_fp8_uses_a_tuned_config(monkeypatch, tmp_path):
    _pretend_gpu(monkeypatch, tmp_path)
    M, K, N = 256, 256, 128
    x = torch.zeros(M, K, dtype=torch.float16)
    w = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
    tuned = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "GROUP_M": 4, "num_warps": 4, "num_stages": 4}
    tuning.write_table("Test GPU", {tuning.key("fp8-w8a16", M, N, K): tuned}, tmp_path)
    launch, _ = fp8.plan(x, w, torch.ones(N, 1), "w8a16", None, None)
    assert (launch.meta["BLOCK_M"], launch.meta["GROUP_M"], launch.meta["num_stages"]) == (64, 4, 4)
    launch, _ = fp8.plan(x, w, torch.ones(N, 1), "w8a8", None, None)
    assert launch.meta["BLOCK_M"] == 128  # the W8A8 key is absent: heuristic
