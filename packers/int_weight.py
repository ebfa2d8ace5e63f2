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

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from infer_tool.common.errors import BadInput
from infer_tool.packers.deploy import Deploy


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

    def rows(self, rows: slice) -> QuantizedWeight:
        """The weight of rows `rows` (one linear of a stacked solve); g_idx is shared."""
        zero = None if self.zero is None else self.zero[rows]
        return replace(self, q=self.q[rows], scale=self.scale[rows], zero=zero, info=dict(self.info))

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

    def int8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(`weight` int8 (N, K), `weight_scale` float32 (N, G)) of symmetric 8-bit codes with
        contiguous groups, as compressed-tensors' `int-quantized` stores them: the signed codes
        q - 128 (no act-order g_idx: the format has none for INT8)."""
        if self.bits != 8 or not self.symmetric:
            raise ValueError(f"int8: needs symmetric 8-bit codes, got bits={self.bits} symmetric={self.symmetric}")
        if not self.has_trivial_g_idx():
            raise ValueError("int8: act-order group indices cannot be stored in int-quantized checkpoints")
        codes = self.q.to(torch.int16) - (1 << (self.bits - 1))
        return codes.to(torch.int8), self.scale.float()

    @property
    def label(self) -> str:
        return f"{self.bits}-bit"

    def takes_int8_activations(self, deploy: Deploy) -> bool:
        """INT4 (served W4A8 on AMX) and W8A8 checkpoints take int8 activations."""
        return self.bits == 4 or deploy.quantized_activations

    def to_linear(self, bias: torch.Tensor | None, dtype: torch.dtype, deploy: Deploy, where: str) -> Any:
        """The kernels' `Int4Linear` (4-bit) or `Int8Linear` (8-bit symmetric, groups in order),
        its activations int8 where `deploy` says so."""
        from infer_tool.kernels.int8_act import vllm_kernel
        from infer_tool.kernels.quant_linear import Int4Linear, Int8Linear

        quantize_acts = deploy.activations == "int8" or (deploy.activations == "auto" and deploy.quantized_activations)
        acts = "int8" if quantize_acts else "none"
        if deploy.int8_kernel != "auto":
            kernel = deploy.int8_kernel
        elif self.bits == 4:
            kernel = "sgl"  # W4A8 exists only on vLLM's AMX path
        else:
            kernel = vllm_kernel(deploy.device_type, *self.shape)
        if self.bits == 4:
            scale = self.scale.to(dtype)
            return Int4Linear.from_unpacked(self.q, scale, self.zero, self.g_idx, self.group_size, bias, acts, kernel)
        if self.bits == 8 and self.symmetric and self.has_trivial_g_idx():
            w8, scale = self.int8()
            return Int8Linear(w8, scale, self.input_scale, bias, acts, kernel)
        raise BadInput(
            f"{where} has {self.bits}-bit {'symmetric' if self.symmetric else 'asymmetric'} "
            "weights; the kernels take 4-bit, and 8-bit symmetric ones"
        )

    @classmethod
    def activations_note(
        cls, layers: Mapping[str, QuantizedWeight], deploy: Deploy, kernels: set[str], dtype: torch.dtype
    ) -> str:
        """'activations unquantized', or how int8 activations were rounded (W8A8, W4A8)."""
        if deploy.activations == "none" or not kernels:
            return "activations unquantized"
        how = f"int8 activations rounded as vLLM's {'/'.join(sorted(kernels))} kernel"
        if deploy.quantized_activations:
            static = any(w.input_scale is not None for w in layers.values())
            if static and "sgl" in kernels:
                return f"{how}: static input_scale read only where oneDNN runs; the AMX (sgl) path quantizes per token"
            return f"{how}: {'static per-tensor input_scale' if static else 'per token, dynamic'}"
        note = f"{how}: W4A8 per token, as vLLM's CPU build serves INT4 on AMX CPUs (VLLM_CPU_INT4_W4A8=1)"
        if dtype != torch.bfloat16:
            note += "; vLLM takes W4A8 only for bfloat16 models (this evaluation is not bfloat16)"
        return note

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
