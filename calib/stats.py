"""`LayerStats`: what calibration measured at the input of one linear layer, and how it
is accumulated, saved and loaded.

For inputs x (K,) seen over T tokens:
- `H` (K, K) fp32 = (1/T) Σ 2·x·xᵀ, the GPTQ Hessian of the layer-wise loss ‖WX − ŴX‖²
  (Frantar et al. 2022, §2 eq. 1). Accumulated as an fp64 pairwise sum over calibration
  chunks of per-chunk fp32 products, upper block triangle only (H is symmetric: a third to
  40% fewer flops), mirrored at the end.
- `act_abs_mean` (K,) = (1/T) Σ |x|, the per-input-channel magnitude AWQ scales by
  (Lin et al. 2023, §3.2).
- `act_abs_max` = max |x| over every token and channel.
- `act_abs_max_channel` (K,) = max |x_j| over the tokens, per input channel (SmoothQuant's
  statistic, Xiao et al. 2023 §4); None in statistics saved before it was measured.
- `tokens` = T.

Linears that read the same tensor (q/k/v, gate/up) share one `LayerStats`.

This module knows nothing about models or layer names beyond the strings it is given,
and nothing about which solver uses which statistic.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from infer_tool.calib.distributed import TreeSum, all_max, all_sum, current_chunk
from infer_tool.common.errors import BadInput, untrusted
from infer_tool.common.outdir import check_out_dir, make_readable, replace_dir, sign

STATS_INDEX = "stats_index.json"
# A statistics directory written before owner records (common/outdir.py): its files, its index's keys.
STATS_FILES = re.compile(r"stats\.safetensors|stats_index\.json")
STATS_KEYS = ("version", "meta", "layers")
STATS_VERSION = 2  # 2 adds act_abs_max_channel; version 1 files load without it
READ_VERSIONS = (1, 2)


@dataclass
class LayerStats:
    H: torch.Tensor | None  # (K, K) fp32, or None when the Hessian was not asked for
    act_abs_mean: torch.Tensor  # (K,) fp32
    act_abs_max: float
    tokens: int
    act_abs_max_channel: torch.Tensor | None = None  # (K,) fp32

    @property
    def in_features(self) -> int:
        return int(self.act_abs_mean.shape[0])

    def divided(self, s: torch.Tensor) -> LayerStats:
        """The statistics of the inputs x / s (s (K,) > 0, per input channel), exactly:
        H / (s sᵀ), mean|x| / s, max|x_j| / s_j (needs `act_abs_max_channel`)."""
        if self.act_abs_max_channel is None:
            raise ValueError("LayerStats.divided needs the per-channel maxima (act_abs_max_channel)")
        s = s.detach().float().cpu()
        channel = self.act_abs_max_channel / s
        H = None if self.H is None else self.H / (s.view(-1, 1) * s.view(1, -1)).to(self.H.device)
        return LayerStats(
            H, self.act_abs_mean / s.to(self.act_abs_mean.device), float(channel.max()), self.tokens, channel
        )


class StatsAccumulator:
    """Sums for one linear input; `add(x)` with x (..., K), `result()` at the end.

    Each calibration chunk's terms are summed in float64 (fp32 products within a piece of
    `chunk_tokens` tokens); the chunks' sums are added pairwise over the chunk index, and
    across processes in the same order (`calib/distributed.py`): one process and several
    give the same bits. Memory: Σ x xᵀ of one chunk plus at most ⌈log₂ chunks⌉ + 1 partial sums."""

    def __init__(self, in_features: int, hessian: bool = True, chunk_tokens: int = 8192, block: int = 256) -> None:
        self.in_features = in_features
        self.hessian = hessian
        self.chunk_tokens = chunk_tokens
        self.block = -(
            -in_features // -(-in_features // block)
        )  # rows per block-row of the triangular Σ x xᵀ (equal splits)
        self.xx = TreeSum()  # (K, K) fp64 Σ x xᵀ, upper block triangle filled
        self.abs_sum = TreeSum()  # (K,) fp64 Σ |x|
        self.abs_max_channel: torch.Tensor | None = None  # (K,) fp32 max |x_j|
        self.tokens = 0
        self.calls = 0
        self.device: torch.device | None = None

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])  # (T, K)
        if x.shape[1] != self.in_features:
            raise ValueError(f"input has {x.shape[1]} features, expected {self.in_features}")
        if x.shape[0] == 0:
            return
        self.device = x.device
        K, b = self.in_features, self.block
        index = current_chunk(self.calls)
        self.calls += 1
        for start in range(0, x.shape[0], self.chunk_tokens):
            xc = x[start : start + self.chunk_tokens].float()  # (t, K)
            a = xc.abs()
            self.abs_sum.at(index, lambda: torch.zeros(K, dtype=torch.float64, device=x.device)).add_(
                a.sum(0).double()
            )  # fp32 within a piece, fp64 across
            m = a.amax(0)  # (K,)
            self.abs_max_channel = m if self.abs_max_channel is None else torch.maximum(self.abs_max_channel, m)
            if self.hessian:
                leaf = self.xx.at(index, lambda: torch.zeros(K, K, dtype=torch.float64, device=x.device))
                for i in range(0, K, b):  # fp32 products, added into fp64 without an fp64 copy
                    leaf[i : i + b, i:].add_(xc[:, i : i + b].T @ xc[:, i:])
        self.tokens += int(x.shape[0])

    def result(self, empty_ok: bool = False) -> LayerStats | None:
        """The statistics over every process's tokens (a collective under several processes);
        with `empty_ok`, None when no token reached this input anywhere."""
        tokens = int(all_sum(torch.tensor([self.tokens]))[0])
        if tokens == 0:
            self.xx, self.abs_sum = TreeSum(), TreeSum()
            if empty_ok:
                return None
            raise ValueError("no calibration tokens reached this layer")
        dev = self.device or (torch.device("cuda", torch.cuda.current_device()) if _nccl() else torch.device("cpu"))
        K = self.in_features
        abs_sum = self.abs_sum.total(torch.zeros(K, dtype=torch.float64, device=dev))
        H = None
        if self.hessian:
            xx = self.xx.total(torch.zeros(K, K, dtype=torch.float64, device=dev))
            xx = xx.triu() + xx.triu(1).T  # the upper triangle lies within the summed blocks
            H = (2.0 * xx / tokens).float().cpu()
        local = self.abs_max_channel if self.abs_max_channel is not None else torch.zeros(K)
        channel = torch.tensor(all_max(local.double().tolist()), dtype=torch.float32)  # exact: fp32 values
        return LayerStats(
            H=H,
            act_abs_mean=(abs_sum / tokens).float().cpu(),
            act_abs_max=float(channel.max()),
            tokens=tokens,
            act_abs_max_channel=channel,
        )


class CrossAccumulator:
    """GPTAQ's dXXᵀ (K, K) = 2·Σ (x̃ − x)·xᵀ / T for one linear input: x from the quantized
    chain, x̃ the fp model's input on the same token (`packers/gptq.gptaq_target`).

    `add(x_fp, x)` with both (..., K), the chunks in StatsAccumulator's order; summed as its
    Hessian is (fp32 products within a piece, fp64 pairwise over the chunk index), over every
    column (dXXᵀ is not symmetric)."""

    def __init__(self, in_features: int, chunk_tokens: int = 8192) -> None:
        self.in_features = in_features
        self.chunk_tokens = chunk_tokens
        self.sum = TreeSum()
        self.tokens = 0
        self.calls = 0
        self.device: torch.device | None = None

    @torch.no_grad()
    def add(self, x_fp: torch.Tensor, x: torch.Tensor) -> None:
        K = self.in_features
        x, x_fp = x.reshape(-1, x.shape[-1]), x_fp.reshape(-1, x_fp.shape[-1])
        if x.shape != x_fp.shape or x.shape[1] != K:
            raise ValueError(f"paired inputs {tuple(x_fp.shape)} and {tuple(x.shape)}: expected the same (T, {K})")
        self.device = x.device
        leaf = self.sum.at(current_chunk(self.calls), lambda: torch.zeros(K, K, dtype=torch.float64, device=x.device))
        self.calls += 1
        for start in range(0, x.shape[0], self.chunk_tokens):
            xc = x[start : start + self.chunk_tokens].float()
            d = x_fp[start : start + self.chunk_tokens].float().to(xc.device) - xc
            leaf.add_(d.T @ xc)
        self.tokens += int(x.shape[0])

    def result(self) -> torch.Tensor:
        """dXXᵀ (K, K) fp32 on the CPU, over every process's tokens (a collective under several)."""
        tokens = int(all_sum(torch.tensor([self.tokens]))[0])
        K = self.in_features
        dev = self.device or (torch.device("cuda", torch.cuda.current_device()) if _nccl() else torch.device("cpu"))
        total = self.sum.total(torch.zeros(K, K, dtype=torch.float64, device=dev))
        return (2.0 * total / max(tokens, 1)).float().cpu()


def _nccl() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"


def relative_output_error(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> float:
    """‖(Ŵ − W)X‖ / ‖WX‖ over the calibration tokens, computed from H = 2XXᵀ/T.

    W, W_hat (N, K); H (K, K). Exact for the inputs H was measured on: ‖AX‖² = tr(A XXᵀ Aᵀ).
    """
    H = H.float()
    W = W.float()
    D = W_hat.float() - W
    num = ((D @ H) * D).sum(dtype=torch.float64)  # fp32 products, fp64 sums: a reported figure
    den = ((W @ H) * W).sum(dtype=torch.float64)
    return float((num.clamp_min(0) / den.clamp_min(1e-30)).sqrt())


def check_stats_out(out: str | os.PathLike[str], *, overwrite: bool, protected: tuple[Path, ...] = ()) -> None:
    """`check_out_dir` for a statistics directory."""
    check_out_dir(
        out, overwrite=overwrite, marker=STATS_INDEX, protected=protected, legacy=STATS_FILES, legacy_keys=STATS_KEYS
    )


def save_stats(
    stats: dict[str, LayerStats],
    out_dir: Path,
    meta: dict[str, object],
    overwrite: bool = False,
) -> Path:
    """Write `stats` (keyed by linear name; shared objects stored once) to `out_dir`.

    Layout: `stats.safetensors` holds `<key>.H`, `<key>.act_abs_mean` and
    `<key>.act_abs_max_channel`, with `key` the first linear name sharing that object;
    `stats_index.json` maps every linear name to its key, `act_abs_max` and `tokens`,
    plus `meta`. Written into a temporary directory
    beside `out_dir` and renamed at the end.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    check_stats_out(out_dir, overwrite=overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tensors: dict[str, torch.Tensor] = {}
        keys: dict[int, str] = {}
        index: dict[str, dict[str, object]] = {}
        for name in sorted(stats):
            s = stats[name]
            key = keys.get(id(s))
            if key is None:
                key = keys[id(s)] = name
                tensors[f"{key}.act_abs_mean"] = s.act_abs_mean.contiguous()
                if s.act_abs_max_channel is not None:
                    tensors[f"{key}.act_abs_max_channel"] = s.act_abs_max_channel.contiguous()
                if s.H is not None:
                    tensors[f"{key}.H"] = s.H.contiguous()
            index[name] = {"key": key, "act_abs_max": s.act_abs_max, "tokens": s.tokens}
        save_file(tensors, str(tmp / "stats.safetensors"), metadata={"format": "infer-tool-stats"})
        doc = {"version": STATS_VERSION, "meta": meta, "layers": index}
        (tmp / STATS_INDEX).write_text(json.dumps(doc, indent=2, sort_keys=True))
        sign(tmp, "stats", STATS_INDEX)
        make_readable(tmp)
        replace_dir(tmp, out_dir, STATS_INDEX, STATS_FILES, STATS_KEYS)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def check_activation_ranges(stats_dir: Path, what: str) -> None:
    """BadInput, before any work, when a statistics directory's layers lack a finite
    `act_abs_max` (static activation scales, `what`, need one per linear)."""
    index_path = Path(stats_dir) / STATS_INDEX
    with untrusted(f"{index_path}"):
        layers = json.loads(index_path.read_text(encoding="utf-8"))["layers"]
        bad = sorted(
            n
            for n, e in layers.items()
            if not isinstance(e.get("act_abs_max"), (int, float)) or not 0 <= e["act_abs_max"] < float("inf")
        )
    if bad:
        raise BadInput(
            f"--stats {str(stats_dir)!r}: {len(bad)} of its {len(layers)} linears have no activation range "
            f"(a finite act_abs_max; first: {bad[0]}), which {what} need; "
            "recalibrate with `infer-tool calibrate`"
        )


def saved_version(stats_dir: Path) -> int | None:
    """The version a statistics directory was saved with (None when it has no readable index)."""
    try:
        doc = json.loads((Path(stats_dir) / STATS_INDEX).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    version = doc.get("version") if isinstance(doc, dict) else None
    return version if isinstance(version, int) else None


def load_stats(stats_dir: Path) -> tuple[dict[str, LayerStats], dict[str, object]]:
    """Read what `save_stats` wrote: ({linear name: LayerStats}, meta). Shared stats stay shared;
    version-1 files have no per-channel maxima (`act_abs_max_channel` None)."""
    from safetensors.torch import load_file

    stats_dir = Path(stats_dir)
    index_path = stats_dir / STATS_INDEX
    if not index_path.is_file():
        raise BadInput(
            f"{stats_dir} is not a statistics directory (no {STATS_INDEX}); make one with `infer-tool calibrate`"
        )
    with untrusted(f"{index_path}"):
        doc = json.loads(index_path.read_text(encoding="utf-8"))
    version = doc.get("version") if isinstance(doc, dict) else None
    if version not in READ_VERSIONS:
        raise BadInput(f"{stats_dir}: statistics version {version} is not one of {READ_VERSIONS}; recalibrate")
    by_key: dict[str, LayerStats] = {}
    out: dict[str, LayerStats] = {}
    with untrusted(f"{stats_dir}: statistics files"):
        tensors = load_file(str(stats_dir / "stats.safetensors"))
        for name, entry in doc["layers"].items():
            key = entry["key"]
            if key not in by_key:
                by_key[key] = LayerStats(
                    H=tensors.get(f"{key}.H"),
                    act_abs_mean=tensors[f"{key}.act_abs_mean"],
                    act_abs_max=float(entry["act_abs_max"]),
                    tokens=int(entry["tokens"]),
                    act_abs_max_channel=tensors.get(f"{key}.act_abs_max_channel"),
                )
            out[name] = by_key[key]
    return out, dict(doc.get("meta") or {})
