"""Built-in model and GPU presets, loaded from the JSON files next to this module.

Model presets are config.json excerpts (see `models.json`, each with its source URL) and
go through the same reader as a user's config; GPU presets give the driver-reported
memory and, where a log showed it, the total CUDA reports (what vLLM plans with).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from infer_tool.common.errors import BadInput

_HERE = Path(__file__).parent


@dataclass(frozen=True)
class ModelPreset:
    key: str
    hf_id: str
    source: str
    config: dict[str, Any]


@dataclass(frozen=True)
class GpuPreset:
    """A GPU: driver-reported memory (`memory_bytes`, nvidia-smi's figure), the total CUDA
    reports (`cuda_memory_bytes`, None where no source was found), and the datasheet
    figures the speed model uses (None where the vendor does not state them)."""

    key: str
    name: str
    memory_bytes: int
    source: str
    hbm_bytes_per_s: float | None = None
    bf16_flops: float | None = None  # dense tensor FLOP/s
    fp8_flops: float | None = None
    link_bytes_per_s: float | None = None  # per GPU, one direction
    spec_source: str = ""
    cuda_memory_bytes: int | None = None
    cuda_source: str = ""
    compute_capability: str = ""  # "9.0", or a ROCm arch such as "gfx942"

    @property
    def total_bytes(self) -> int:
        """The total vLLM takes --gpu-memory-utilization of: CUDA's, else the driver's."""
        return self.cuda_memory_bytes if self.cuda_memory_bytes is not None else self.memory_bytes

    @property
    def has_speed(self) -> bool:
        return self.hbm_bytes_per_s is not None and self.bf16_flops is not None


@cache
def model_presets() -> dict[str, ModelPreset]:
    data = json.loads((_HERE / "models.json").read_text())
    return {k: ModelPreset(k, v["hf_id"], v["source"], v["config"]) for k, v in data.items() if not k.startswith("_")}


@cache
def gpu_presets() -> dict[str, GpuPreset]:
    data = json.loads((_HERE / "gpus.json").read_text())
    return {k: GpuPreset(key=k, **v) for k, v in data.items() if not k.startswith("_")}


def _norm(s: str) -> str:
    return s.lower().replace("_", "-").replace(" ", "")


def find_model_preset(spec: str) -> ModelPreset | None:
    """A preset by key or Hugging Face id (case-insensitive), else None."""
    want = _norm(spec)
    for p in model_presets().values():
        if want in (_norm(p.key), _norm(p.hf_id), _norm(p.hf_id.split("/")[-1])):
            return p
    return None


def gpu_preset(spec: str) -> GpuPreset:
    want = _norm(spec)
    for p in gpu_presets().values():
        if want == _norm(p.key):
            return p
    raise BadInput(f"unknown GPU {spec!r}; {suggest(spec, list(gpu_presets()))} (see --list-gpus, or give --gpu-mem)")


def suggest(spec: str, names: list[str]) -> str:
    """'did you mean: a, b' from the nearest names, else the accepted list."""
    import difflib  # only on the error path

    by_norm = {_norm(n): n for n in names}
    near = difflib.get_close_matches(_norm(spec), list(by_norm), n=3, cutoff=0.5)
    if near:
        return "did you mean: " + ", ".join(by_norm[n] for n in near)
    return "accepted: " + ", ".join(names)
