"""`QuantizedWeight`: the canonical in-memory result of an INT solver for one linear layer.

Layout (unpacked, unsigned, original column order):
- `q`      uint8 `(N, K)`, values 0 .. 2^bits - 1
- `scale`  fp32  `(N, G)` with G = number of groups (K / group_size)
- `zero`   uint8 `(N, G)`, or None for symmetric (zero point 2^(bits-1) implied)
- `g_idx`  int32 `(K,)`: the group of input column k, or None meaning k // group_size
- `input_scale` fp32 `(1,)`: the static int8 activation scale of a W8A8 linear, or None

Dequantized weight: W[n, k] = (q[n, k] - zero[n, g_idx[k]]) * scale[n, g_idx[k]].
The format writers (compressed_tensors, awq_gemm, gptq_v1) translate this layout; this
module knows nothing about files.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch


@dataclass
class QuantizedWeight:
    q: torch.Tensor  # (N, K) uint8
    scale: torch.Tensor  # (N, G) float32
    zero: torch.Tensor | None  # (N, G) uint8, None = symmetric
    g_idx: torch.Tensor | None  # (K,) int32, None = k // group_size
    bits: int
    group_size: int  # columns per group (K for per-channel)
    info: dict[str, Any] = field(default_factory=dict)  # solver report (fallback, damp, ...)
    input_scale: torch.Tensor | None = None  # (1,) float32, static int8 activations only

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) = (out_features, in_features)."""
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    @property
    def num_groups(self) -> int:
        return int(self.scale.shape[1])

    def group_index(self) -> torch.Tensor:
        """(K,) int64: the group of every input column."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.shape[1], device=self.q.device) // self.group_size

    def zero_points(self) -> torch.Tensor:
        """(N, G) int: the zero points, the implied 2^(bits-1) when symmetric."""
        if self.zero is not None:
            return self.zero.to(torch.int32)
        return torch.full_like(self.scale, 1 << (self.bits - 1), dtype=torch.int32)

    def has_trivial_g_idx(self) -> bool:
        """True when column k belongs to group k // group_size (no reordering stored)."""
        if self.g_idx is None:
            return True
        k = torch.arange(self.shape[1], device=self.g_idx.device)
        return bool(torch.equal(self.g_idx.long(), k // self.group_size))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) weight in `dtype`: (q - zero[:, g]) * scale[:, g]."""
        g = self.group_index()  # (K,)
        z = self.zero_points()[:, g].float()  # (N, K)
        s = self.scale.float()[:, g]  # (N, K)
        return ((self.q.float() - z) * s).to(dtype)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """A copy with every tensor on `device`."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(
            self,
            q=move(self.q),
            scale=move(self.scale),
            zero=move(self.zero),
            g_idx=move(self.g_idx),
            input_scale=move(self.input_scale),
        )

    def validate(self) -> None:
        """Raise ValueError when fields disagree on shapes, dtypes or ranges."""
        n, k = self.shape
        if self.q.dtype != torch.uint8:
            raise ValueError(f"q must be uint8, got {self.q.dtype}")
        if int(self.q.max()) >= 1 << self.bits:
            raise ValueError(f"q holds values above {2**self.bits - 1}")
        if self.scale.shape[0] != n:
            raise ValueError(f"scale rows {self.scale.shape[0]} != N={n}")
        if self.zero is not None and self.zero.shape != self.scale.shape:
            raise ValueError(f"zero {tuple(self.zero.shape)} != scale {tuple(self.scale.shape)}")
        if self.g_idx is None and self.num_groups * self.group_size != k:
            raise ValueError(f"{self.num_groups} groups of {self.group_size} != K={k}")
        if self.g_idx is not None and (self.g_idx.shape != (k,) or int(self.g_idx.max()) >= self.num_groups):
            raise ValueError("g_idx must be (K,) with values < number of groups")
