"""What tests/test_guard.py compares: the machine fingerprint that byte-exact hashes are
keyed by, and each checkpoint read back into a canonical, format-free form with the
tolerant comparison of two such forms.

Canonical form of one checkpoint directory (`extract`): per quantized linear `L` (module
path), in the logical layout of its weight W (N, K), whatever the file format:
- `L:codes`  uint8 (N, K): INT4 codes q in [0, 16) (the unsigned code; signed formats + 8),
             the bit patterns of FP8 e4m3 weights, or E2M1 codes (FP4: bit 3 the sign, bits 0-2
             the magnitude index into 0, 0.5, 1, 1.5, 2, 3, 4, 6);
- `L:scale`  float32 (N, G) per group of K (INT4; FP4: the effective scale, NVFP4's E4M3 over
             its global scale or MXFP4's 2^(u-127)), (N, 1) per channel, (1, 1) per tensor or
             (N, ceil(K/128)) per 128 x 128 block (FP8; each block row repeated for its rows);
- `L:zero`   uint8 (N, G) unsigned zero points (asymmetric INT4 only);
- `L:g_idx`  int32 (K,) group of every input channel (GPTQ v1 only);
and every other tensor (norms, embeddings, input / k / v scales, statistics) as float32
under its own name. W is dequantized from these (`dequantize`): (q - zero)·scale for INT4
(zero = 8 when symmetric), fp8(q)·scale for FP8, e2m1(q)·scale for FP4. The reference keeps only some rows of each
tensor (`extract(rows=...)`: evenly spaced along dim 0), so that it stays small.

The readers here are written from the format descriptions (compressed-tensors
pack-quantized, float-quantized and nvfp4/mxfp4-pack-quantized, AWQ GEMM, GPTQ v1, native
fp8) and share no code with the writers they check.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from collections.abc import Mapping
from pathlib import Path

import torch

# CPU features that select different kernels in torch, MKL or oneDNN (and so round differently).
KERNEL_FLAGS = (
    "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
)  # fmt: skip
# Environment settings that override those choices.
KERNEL_ENV = (
    "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "MKL_DEBUG_CPU_TYPE", "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE",
)  # fmt: skip
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # FP4 magnitudes by the code's low three bits
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble i of a word holds output column 8j + AWQ_ORDER[i]
FP8_BLOCK = 128


def cpu_info() -> dict[str, object]:
    """vendor, family, model, model name and the KERNEL_FLAGS present, from /proc/cpuinfo
    (elsewhere: platform.processor() and torch's own CPU probes)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.split("\n\n", 1)[0].splitlines():  # the first processor
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    if "flags" in fields:
        flags = set(fields["flags"].split())
    else:  # no /proc/cpuinfo: what torch can tell
        probes = {
            "avx2": "_is_avx2_supported",
            "avx512f": "_is_avx512_supported",
            "avx512_bf16": "_is_avx512_bf16_supported",
            "amx_tile": "_is_amx_tile_supported",
            "amx_fp16": "_is_amx_fp16_supported",
        }
        flags = {f for f, fn in probes.items() if getattr(torch.cpu, fn, lambda: False)()}
    return {
        "vendor": fields.get("vendor_id", platform.processor() or platform.machine()),
        "family": fields.get("cpu family", ""),
        "model": fields.get("model", ""),
        "model_name": fields.get("model name", ""),
        "isa": sorted(flags & set(KERNEL_FLAGS)),
    }


def torch_build() -> dict[str, str]:
    """torch's version, BLAS and the MKL / oneDNN versions it was built with."""
    show = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([^\s]+)", show)
    onednn = re.search(r"MKL-DNN v([^\s]+)", show)
    blas = re.search(r"BLAS_INFO=([^,\s]+)", show)
    return {
        "torch": torch.__version__,
        "blas": blas.group(1) if blas else "",
        "mkl": mkl.group(1) if mkl else "",
        "onednn": onednn.group(1) if onednn else "",
    }


def fingerprint() -> dict[str, object]:
    """Everything the bytes of a CPU-written checkpoint depend on besides our code: the CPU
    (vendor, model, kernel-selecting ISA flags), the torch build, the CPU capability torch
    dispatches to, any environment override of torch's, MKL's or oneDNN's kernel choice, and
    torch's thread count (reductions split by thread)."""
    return {
        "cpu": cpu_info(),
        "build": torch_build(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "env": {k: os.environ[k] for k in KERNEL_ENV if os.environ.get(k)},
        "threads": torch.get_num_threads(),
    }


def fingerprint_id(fp: Mapping[str, object]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def describe(fp: Mapping[str, object]) -> str:
    cpu, build = fp["cpu"], fp["build"]
    env = " ".join(f"{k}={v}" for k, v in fp["env"].items())
    return (
        f"{cpu['vendor']} {cpu['model_name']} (family {cpu['family']} model {cpu['model']}; {' '.join(cpu['isa'])}), "
        f"torch {build['torch']} (MKL {build['mkl']}, oneDNN {build['onednn']}), capability "
        f"{fp['cpu_capability']}, {fp['threads']} thread(s){', ' + env if env else ''}"
    )


# --- reading a checkpoint into the canonical form -----------------------------------------


def _nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> uint8 4-bit fields, field i of a word (bits 4i) at position 8·w + i along dim."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    fields = torch.stack([(w >> (4 * i)) & 0xF for i in range(8)], dim=dim + 1)  # (..., words, 8, ...)
    shape = list(words.shape)
    shape[dim] *= 8
    return fields.reshape(shape).to(torch.uint8)


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _linear_int4(method: str, t: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    if method == "compressed-tensors":  # weight_packed (N, K/8) along K; zero point (N/8, G) along N
        n, k = (int(v) for v in t.pop(f"{name}.weight_shape").tolist())
        codes = _nibbles(t.pop(f"{name}.weight_packed"), 1)[:, :k]
        scale = t.pop(f"{name}.weight_scale").float()
        zp = t.pop(f"{name}.weight_zero_point", None)
        out = {"q4": codes, "scale": scale}
        if zp is not None:
            out["zero"] = _nibbles(zp, 0)[:n]
        return out
    if method == "awq":  # qweight (K, N/8), qzeros (K/g, N/8) along N in AWQ_ORDER; scales (K/g, N)
        order = torch.tensor(AWQ_ORDER)

        def unpack(words: torch.Tensor) -> torch.Tensor:
            fields = _nibbles(words, 1).reshape(words.shape[0], -1, 8)
            out = torch.empty_like(fields)
            out[:, :, order] = fields
            return out.reshape(words.shape[0], -1)

        codes = unpack(t.pop(f"{name}.qweight")).T.contiguous()
        return {
            "q4": codes,
            "zero": unpack(t.pop(f"{name}.qzeros")).T.contiguous(),
            "scale": t.pop(f"{name}.scales").float().T.contiguous(),
        }
    if method == "gptq":  # qweight (K/8, N) along K; qzeros (K/g, N/8) along N storing zero - 1; g_idx (K,)
        codes = _nibbles(t.pop(f"{name}.qweight"), 0).T.contiguous()
        zero = ((_nibbles(t.pop(f"{name}.qzeros"), 1).to(torch.int16) + 1) & 0xF).to(torch.uint8)
        return {
            "q4": codes,
            "zero": zero.T.contiguous(),
            "scale": t.pop(f"{name}.scales").float().T.contiguous(),
            "g_idx": t.pop(f"{name}.g_idx").to(torch.int32),
        }
    raise ValueError(f"{name}: unknown INT4 format {method!r}")


def _linear_fp4(t: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """compressed-tensors nvfp4/mxfp4-pack-quantized: weight_packed (N, K/2) uint8 holding
    column 2j in the low nibble and 2j+1 in the high; weight_scale (N, K/g) float8_e4m3fn with a
    float32 weight_global_scale (NVFP4: scale / global), or uint8 E8M0 exponents (MXFP4)."""
    packed = t.pop(f"{name}.weight_packed")
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    s = t.pop(f"{name}.weight_scale")
    if s.dtype == torch.float8_e4m3fn:
        scale = s.float() / t.pop(f"{name}.weight_global_scale").float()
    else:
        scale = torch.exp2(s.float() - 127.0)
    return {"fp4": codes, "scale": scale}


def extract(directory: Path, rows: int | None = None) -> dict[str, torch.Tensor]:
    """The canonical form of a checkpoint (see the module docstring). rows: keep only about
    that many rows of each tensor (dim 0 of its logical layout, every ceil(N / rows)-th);
    None keeps everything."""
    directory = Path(directory)
    t = _tensors(directory)
    config = directory / "config.json"
    qc = json.loads(config.read_text()).get("quantization_config", {}) if config.is_file() else {}
    out: dict[str, torch.Tensor] = {}
    int4 = {"weight_packed": "compressed-tensors", "qweight": qc.get("quant_method", "")}
    fp4 = str(qc.get("format", "")).endswith("fp4-pack-quantized")
    for key in sorted(t):
        suffix = key.rsplit(".", 1)[-1]
        if suffix in int4 and key in t:
            name = key[: -len(suffix) - 1]
            parts = _linear_fp4(t, name) if fp4 else _linear_int4(int4[suffix], t, name)
            for part, v in parts.items():
                out[f"{name}:{part}"] = v
    for key in sorted(t):
        if key in t and key.endswith(".weight") and t[key].dtype == torch.float8_e4m3fn:
            name = key[: -len(".weight")]
            scale = t.pop(f"{name}.weight_scale", None)
            scale = (t.pop(f"{name}.weight_scale_inv") if scale is None else scale).float()
            codes = t.pop(key).view(torch.uint8)
            scale = scale.reshape(1, 1) if scale.numel() == 1 else scale.reshape(scale.shape[0], -1)
            if scale.shape[1] > 1:  # per block: one row of block scales per weight row
                scale = scale.repeat_interleave(FP8_BLOCK, dim=0)[: codes.shape[0]]
            out[f"{name}:fp8"] = codes
            out[f"{name}:scale"] = scale
    for key, v in t.items():
        out[key] = v.float() if v.is_floating_point() else v
    if rows is not None:
        out = {
            k: v if k.endswith(":g_idx") or not v.dim() else v[:: max(1, -(-v.shape[0] // rows))]
            for k, v in out.items()
        }
    return out


def linears(c: Mapping[str, torch.Tensor]) -> list[str]:
    return sorted(k.rsplit(":", 1)[0] for k in c if k.endswith((":q4", ":fp8", ":fp4")))


def dequantize(c: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """W (N, K) float64 of linear `name` from its canonical parts (also when only some rows were kept)."""
    scale = c[f"{name}:scale"].double()
    if f"{name}:q4" in c:
        q = c[f"{name}:q4"].double()
        zero = c.get(f"{name}:zero")
        z = zero.double() if zero is not None else torch.full_like(scale, 8.0)
        g_idx = c.get(f"{name}:g_idx")
        k = q.shape[1]
        groups = g_idx.long() if g_idx is not None else torch.arange(k) // (k // scale.shape[1])
        return (q - z[:, groups]) * scale[:, groups]
    if f"{name}:fp4" in c:
        q = c[f"{name}:fp4"].long()
        value = torch.tensor(E2M1, dtype=torch.float64)[q & 7] * (1 - 2 * (q >> 3)).double()
        k = q.shape[1]
        return value * scale[:, torch.arange(k) // (k // scale.shape[1])]
    w = c[f"{name}:fp8"].view(torch.float8_e4m3fn).double()
    if scale.shape[1] == 1:
        return w * scale
    return w * scale[:, torch.arange(w.shape[1]) // FP8_BLOCK]


# --- comparing two canonical forms ---------------------------------------------------------

# Tolerances of one run (see tests/test_guard.py's docstring for what they were measured against).
TOLERANCES = {
    "code_flips": 0.04,
    "scale_rel": 0.015,
    "weight_rel": 0.06,
    "float_rel": 2e-3,
}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (float64; 0 when both are zero)."""
    g, w = got.double(), want.double()
    den = float(w.norm())
    num = float((g - w).norm())
    return num / den if den else num


def differences(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """How far two canonical forms of one run are apart:
    code_flips: fraction of INT4 / FP8 / FP4 codes, zero points and g_idx entries that differ;
    scale_rel: ||Δ|| / || || of all the run's scales together (float64);
    weight_rel: ||Δ|| / || || of all the run's dequantized weights together;
    float_rel: the largest ||Δ|| / || || of any other tensor (norms, embeddings, statistics,
    input and KV scales)."""
    if sorted(got) != sorted(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise AssertionError(f"tensors differ: missing {missing[:5]}, unexpected {extra[:5]}")
    for key, b in want.items():
        if got[key].shape != b.shape:
            raise AssertionError(f"{key}: shape {tuple(got[key].shape)}, recorded {tuple(b.shape)}")
    flips = total = 0
    sums = {"scale": [0.0, 0.0], "weight": [0.0, 0.0]}  # [||Δ||², || ||²]
    float_rel = 0.0

    def add(kind: str, a: torch.Tensor, b: torch.Tensor) -> None:
        sums[kind][0] += float((a.double() - b.double()).pow(2).sum())
        sums[kind][1] += float(b.double().pow(2).sum())

    names = linears(want)
    parts = set()
    for name in names:
        for part in ("q4", "fp8", "fp4", "zero", "g_idx"):
            key = f"{name}:{part}"
            if key in want:
                parts.add(key)
                flips += int((got[key] != want[key]).sum())
                total += want[key].numel()
        parts.add(f"{name}:scale")
        add("scale", got[f"{name}:scale"], want[f"{name}:scale"])
        add("weight", dequantize(got, name), dequantize(want, name))
    for key in sorted(set(want) - parts):
        a, b = got[key], want[key]
        if b.is_floating_point():
            float_rel = max(float_rel, _rel(a, b))
        else:
            flips += int((a != b).sum())
            total += b.numel()
    rel = {k: (d / n) ** 0.5 if n else d**0.5 for k, (d, n) in sums.items()}
    return {
        "code_flips": flips / max(total, 1),
        "scale_rel": rel["scale"],
        "weight_rel": rel["weight"],
        "float_rel": float_rel,
    }


def exceeded(diff: Mapping[str, float], tolerances: Mapping[str, float] = TOLERANCES) -> list[str]:
    """The metrics of `differences` over their `tolerances`, as 'name value > limit'."""
    return [f"{k} {diff[k]:.3g} > {limit:g}" for k, limit in tolerances.items() if diff[k] > limit]


# --- the committed reference: canonical forms of every run, each distinct tensor stored once -----


def _pack_q4(q: torch.Tensor) -> torch.Tensor:
    flat = q.flatten()
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return (flat[0::2] | (flat[1::2] << 4)).contiguous()


def _unpack_q4(packed: torch.Tensor, shape: list[int]) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    out = torch.stack([packed & 0xF, packed >> 4], dim=1).flatten()[:n]
    return out.reshape(shape).contiguous()


def save_reference(path: Path, forms: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Write {run: canonical form} to `path` (gzip of a safetensors file whose metadata maps
    run -> tensor -> stored key; INT4 codes two to a byte)."""
    import gzip

    from safetensors.torch import save

    stored: dict[str, torch.Tensor] = {}
    index: dict[str, dict[str, list[object]]] = {}
    for run in sorted(forms):
        index[run] = {}
        for name, t in sorted(forms[run].items()):
            q4 = name.endswith((":q4", ":fp4", ":zero"))
            data = _pack_q4(t) if q4 else t.contiguous()
            key = hashlib.sha256(str((data.dtype, list(t.shape), q4)).encode() + data.numpy().tobytes()).hexdigest()[
                :20
            ]
            stored.setdefault(key, data)
            index[run][name] = [key, list(t.shape), q4]
    blob = save(stored, metadata={"index": json.dumps(index, sort_keys=True)})
    path.write_bytes(gzip.compress(blob, compresslevel=9, mtime=0))


def load_reference(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    import gzip

    from safetensors.torch import load

    if not path.is_file():
        return {}
    blob = gzip.decompress(path.read_bytes())
    stored = load(blob)
    header_len = int.from_bytes(blob[:8], "little")
    index = json.loads(json.loads(blob[8 : 8 + header_len])["__metadata__"]["index"])
    return {
        run: {name: _unpack_q4(stored[key], shape) if q4 else stored[key] for name, (key, shape, q4) in parts.items()}
        for run, parts in index.items()
    }
