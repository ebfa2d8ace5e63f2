"""Before any work: the peak host and device memory a quantize run will need, estimated
from the model's shape and the calibration settings, checked against what the machine
has free (or `--max-memory`).

The estimate is a sum of named terms, in bytes (activations are float32, B x T tokens of
width D, the MLP's width I):
- runtime: Python, torch, transformers and the tokenizer, measured (RUNTIME_BYTES);
- weights: streamed, the larger of the tensors outside the layers (embeddings, norm,
  lm_head, in float32, plus their checkpoint copy) and one layer (float32 + its written
  copy); loaded whole, every parameter in float32;
- calibration: the layer inputs X and outputs Ŷ (2·T·D), the rotary tables, one chunk's
  way through a layer (the attention's and MLP's intermediates), the solver's copies of
  the largest weight, and what the method keeps: with a Hessian (GPTQ) H with its
  factors and, unless they are kept in a file (`calib/spill.py`, `plan`), the replayed
  attention and MLP outputs and the down_proj input (2·T·D + T·I);
  with activation statistics (AWQ) the fp block outputs Y (T·D); a data-free method (RTN)
  runs only the ERROR_SAMPLES sequences;
- eval (--eval): the fp and quantized hidden states of every window (2·E·D), and the
  logits of one window while it is scored (3·S·V: logits, their float copy, the softmax).
On CUDA, the layer, the activations and the eval streams are counted on the device; the
host keeps the tensors outside the layers and stages one layer and one copy of X.

`benchmarks/streaming_memory.py` prints the estimate beside the measured peak.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from infer_tool.common.errors import BadInput

MIB = 2**20
# Peak RSS of `infer-tool quantize` on a 2-layer, width-64 model (nothing else is resident):
# Python, torch, transformers, safetensors, the tokenizer. Measured (torch 2.13 CPU, transformers 5.24).
RUNTIME_BYTES = 480 * MIB
F32 = 4


@dataclass
class MemoryEstimate:
    host: int  # bytes
    device: int | None  # bytes on the accelerator, None on a CPU run
    terms: dict[str, int] = field(default_factory=dict)  # host terms (device terms prefixed "device.")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"estimate_host_mib": round(self.host / MIB, 1)}
        if self.device is not None:
            out["estimate_device_mib"] = round(self.device / MIB, 1)
        out["estimate_terms_mib"] = {k: round(v / MIB, 1) for k, v in self.terms.items()}
        return out


def weight_numels(model: Any, layers_path: str) -> tuple[int, int]:
    """(parameters outside the decoder layers, parameters of the largest layer), tied tensors once."""
    seen: set[int] = set()
    rest = 0
    per_layer: dict[str, int] = {}
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name.startswith(f"{layers_path}."):
            layer = name[len(layers_path) + 1 :].split(".", 1)[0]
            per_layer[layer] = per_layer.get(layer, 0) + p.numel()
        else:
            rest += p.numel()
    return rest, max(per_layer.values(), default=0)


def estimate(
    model: Any, arch: Any, loaded: Any, opts: Any, needs: Any, dev: str, *, spill: bool = False
) -> MemoryEstimate:
    """The run's peak memory (see the module docstring); `spill`: GPTQ's replayed
    activations kept in a file (`calib/spill.py`), not counted."""
    from infer_tool.calib.pipeline import BATCH_SIZE, CPU_BATCH_TOKENS, ERROR_SAMPLES

    config = model.config
    D = int(getattr(config, "hidden_size", 0) or 0)
    inter = int(getattr(config, "intermediate_size", 0) or 4 * D)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    head_dim = int(getattr(config, "head_dim", 0) or D // heads)
    rest_n, layer_n = weight_numels(model, arch.layers)
    total_n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    samples = opts.num_samples if opts.stats is None and opts.layer_error else 0
    if needs.data_free and opts.stats is None:
        samples = min(samples, ERROR_SAMPLES)
    T = samples * opts.seq_len
    act = F32 * T * D
    chunk = min(
        T,
        max(1, CPU_BATCH_TOKENS // opts.seq_len) * opts.seq_len
        if not dev.startswith("cuda")
        else BATCH_SIZE * opts.seq_len,
    )
    calib = {
        "calibration.X+Y_hat": 2 * act,
        "calibration.rotary": 2 * F32 * T * head_dim,
        # one chunk through a layer: q/k/v/o and residuals (6·D), the MLP (4·I), scores and softmax
        "calibration.forward": F32 * chunk * (6 * D + 4 * inter) + 2 * F32 * chunk * heads * opts.seq_len,
        # the solver's copies of the largest weight (W, its rounding, the dequantized values)
        "calibration.solve": 6 * F32 * D * inter,
    }
    if needs.hessian:
        if not spill:
            calib["calibration.replayed+down_input"] = 2 * act + F32 * T * inter
        calib["calibration.hessian"] = 4 * F32 * inter * inter  # H, its inverse and Cholesky factor, a copy
    if needs.activation_stats or needs.live_blocks:
        calib["calibration.block_outputs"] = act
    ev: dict[str, int] = {}
    if opts.eval is not None:
        S = min(opts.eval_seq_len, int(getattr(config, "max_position_embeddings", 0) or opts.eval_seq_len))
        E = opts.eval_tokens // S * S
        ev = {"eval.streams": 2 * F32 * E * D + 2 * F32 * E * head_dim, "eval.logits": 3 * F32 * S * vocab}
    if loaded.stream_plan is not None:
        weights = {"weights.one_layer_or_rest": 2 * F32 * max(rest_n, layer_n)}
    else:
        weights = {"weights.whole_model": F32 * total_n, "weights.one_layer_copy": F32 * layer_n}
    if dev.startswith("cuda"):
        device = {"device.layer": 2 * F32 * layer_n, **{f"device.{k}": v for k, v in {**calib, **ev}.items()}}
        host = {"runtime": RUNTIME_BYTES, **weights, "staging.X": act}
        return MemoryEstimate(sum(host.values()), sum(device.values()), {**host, **device})
    host = {"runtime": RUNTIME_BYTES, **weights, **calib, **ev}
    return MemoryEstimate(sum(host.values()), None, host)


def parse_limits(text: str | None) -> tuple[int | None, int | None]:
    """--max-memory HOST[,DEVICE] -> (host bytes, device bytes), None where not given."""
    if text is None:
        return None, None
    from infer_tool.common.sizes import parse_size

    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) > 2 or not all(parts):
        raise BadInput(f"--max-memory {text!r}: use HOST or HOST,DEVICE, e.g. 20GiB or 20GiB,70GiB")
    host = parse_size(parts[0], "--max-memory", minimum=2**20)
    return host, parse_size(parts[1], "--max-memory", minimum=2**20) if len(parts) == 2 else None


def host_available() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else the physical memory; None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_available(dev: str) -> int | None:
    if not dev.startswith("cuda"):
        return None
    import torch

    return int(torch.cuda.mem_get_info(torch.device(dev))[0])


def plan(model: Any, arch: Any, loaded: Any, opts: Any, needs: Any, dev: str) -> tuple[MemoryEstimate, str | None]:
    """The run's estimate, checked against the limits (`check_fits`). A streamed CPU run
    with a Hessian that does not fit in memory keeps GPTQ's replayed activations in a file
    instead (slower: they go through the page cache) when that fits. Returns (the estimate
    the run goes with, None or the note saying why the activations go to a file)."""
    est = estimate(model, arch, loaded, opts, needs, dev)
    can_spill = needs.hessian and loaded.stream_plan is not None and not dev.startswith("cuda")
    short = host_shortfall(est, opts.max_memory)
    if short is None or not can_spill:
        check_fits(est, opts.max_memory, dev)
        return est, None
    spilled = estimate(model, arch, loaded, opts, needs, dev, spill=True)
    check_fits(spilled, opts.max_memory, dev)
    return spilled, (
        f"GPTQ's replayed activations are kept in a file in the run directory (about "
        f"{spilled.host / 2**30:.2f} GiB in memory, instead of {est.host / 2**30:.2f} GiB, more than {short})"
    )


def host_shortfall(est: MemoryEstimate, max_memory: str | None) -> str | None:
    """None when the host estimate fits the limit (--max-memory, else what is free now), else
    the limit in words."""
    host_limit, _ = parse_limits(max_memory)
    given = host_limit is not None
    host_limit = host_limit if given else host_available()
    if host_limit is None or est.host <= host_limit:
        return None
    return f"the {host_limit / 2**30:.2f} GiB {'--max-memory' if given else 'available on this machine'}"


def check_fits(est: MemoryEstimate, max_memory: str | None, dev: str) -> None:
    """BadInput with both numbers when the estimate exceeds the limit (--max-memory, else
    what is free now)."""
    short = host_shortfall(est, max_memory)
    if short is not None:
        raise BadInput(
            f"this run needs about {est.host / 2**30:.2f} GiB of host memory (estimate), more than "
            f"{short}; lower --num-samples / --seq-len / --eval-tokens, keep --stream, or raise the limit "
            "with --max-memory"
        )
    _, device_limit = parse_limits(max_memory)
    if est.device is None:
        return
    device_limit = device_limit if device_limit is not None else device_available(dev)
    if device_limit is not None and est.device > device_limit:
        raise BadInput(
            f"this run needs about {est.device / 2**30:.2f} GiB of {dev} memory (estimate), more than the "
            f"{device_limit / 2**30:.2f} GiB free there; lower --num-samples / --seq-len / --eval-tokens, "
            "or raise the limit with --max-memory HOST,DEVICE"
        )


def check_processes(opts: Any) -> None:
    """Under several processes (`accelerate launch`), refuse what only one process does."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return
    for given, flag, why in (
        (opts.stats, "--stats", "it runs no calibration to split"),
        (opts.eval, "--eval", "evaluate the checkpoint with `accelerate launch infer-tool eval ppl`"),
        (opts.resume, "--resume", "run it in one process"),
    ):
        if given:
            raise BadInput(f"{flag} does not work across {world} processes: {why}")
