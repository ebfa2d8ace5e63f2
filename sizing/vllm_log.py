"""Read a vLLM start-up log (releases 0.10 to 0.32): the settings the server ran with and
the memory figures it printed. Standard library only; lines it does not know are skipped,
and every figure it looks for and does not find is listed in `missing`.

Lines read (vLLM's own wording; the release that prints each is noted where it matters):
- `vLLM API server version X` (0.10-0.19), the banner's `version X` (0.19+),
  `Initializing a V1 LLM engine (vX) with config: model='...', max_seq_len=N,
  tensor_parallel_size=N, ..., enforce_eager=B, kv_cache_dtype=D, ...,
  enable_prefix_caching=B, ..., 'cudagraph_capture_sizes': [...]`;
- `non-default args: {...}` (a Python dict literal, read with `ast.literal_eval`);
- `Using max model len N`, `Chunked prefill is enabled with max_num_batched_tokens=N`,
  `Asynchronous scheduling is enabled`;
- `Model loading took X GiB` (per worker), `Available KV cache memory: X GiB` (per worker),
  `GPU KV cache size: N tokens`, `Maximum concurrency for L tokens per request: Xx`;
- `Free memory on device (F/T GiB) on startup. Desired GPU memory utilization is (U, R GiB).
  Actual usage is ...` with its breakdown: `W GiB for weight, A GiB for peak activation, N GiB
  for non-torch memory, and G GiB for CUDAGraph memory` (before 0.27) or `C GiB for consumed
  memory (weights + non-torch), A GiB for peak activation, and G GiB for CUDAGraph memory`
  (0.27+; since 0.21 "peak activation" includes the CUDA-graph estimate);
- `Profiling CUDA graph memory: PIECEWISE=n (largest=m), FULL=k`, `Estimated CUDA graph
  memory: X GiB total` (0.19+), `Graph capturing finished in S secs, took X GiB`.
Sizes vLLM prints in GiB with two decimals are kept as printed (GiB floats).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any

MAX_LOG_BYTES = 256 * 2**20
_NUM = r"(-?[0-9][0-9,]*(?:\.[0-9]+)?)"
_WORKER = re.compile(r"\((Worker[^ )]*|VllmWorker rank=[0-9]+|EngineCore[^ )]*|APIServer)[^)]*\)", re.ASCII)
_PATTERNS: dict[str, re.Pattern[str]] = {
    k: re.compile(v, re.ASCII)
    for k, v in {
        "version_api": r"vLLM API server version v?([0-9][0-9A-Za-z.+\-]*)",
        "version_banner": r"\bversion ([0-9]+\.[0-9]+[0-9A-Za-z.+\-]*)\s*$",
        "version_engine": r"Initializing a V1 LLM engine \(v([0-9][0-9A-Za-z.+\-]*)\)",
        "banner_model": r"\bmodel +(\S+)\s*$",
        "non_default": r"non-default args: (\{.*\})\s*$",
        "max_model_len": r"Using max model len ([0-9]+)",
        "chunked": r"max_num_batched_tokens=([0-9]+)",
        "async_on": r"Asynchronous scheduling is enabled",
        "weights": r"Model loading took " + _NUM + r" ?GiB",
        "available": r"Available KV cache memory: " + _NUM + r" ?GiB",
        "kv_tokens": r"\b[A-Z]+ KV cache size: " + _NUM + r" tokens",
        "concurrency": r"Maximum concurrency for " + _NUM + r" tokens per request: " + _NUM + r"x",
        "free": r"Free memory on device \(" + _NUM + r"/" + _NUM + r" GiB\) on startup\. Desired GPU memory "
        r"utilization is \(" + _NUM + r", " + _NUM + r" GiB\)",
        "old_usage": r"Actual usage is "
        + _NUM
        + r" GiB for weight, "
        + _NUM
        + r" GiB for peak activation, "
        + _NUM
        + r" GiB for non-torch memory, and "
        + _NUM
        + r" GiB for CUDAGraph memory",
        "new_usage": r"Actual usage is "
        + _NUM
        + r" GiB for consumed memory \(weights \+ non-torch\), "
        + _NUM
        + r" GiB for peak activation, and "
        + _NUM
        + r" GiB for CUDAGraph memory",
        "graph_counts": r"Profiling CUDA graph memory: PIECEWISE=([0-9]+) \(largest=([0-9]+)\), FULL=([0-9]+)"
        r"(?: \(largest=([0-9]+)\))?",
        "graph_estimate": r"Estimated CUDA graph memory: " + _NUM + r" ?GiB",
        "graph_actual": r"Graph capturing finished in [0-9.]+ secs?, took " + _NUM + r" ?GiB",
        "device": r"device_name=([A-Za-z0-9_\-]+)",
        "util_equiv": r"--gpu-memory-utilization=([0-9.]+) is equivalent to --gpu-memory-utilization=([0-9.]+)",
        "util_from_to": r"increase --gpu-memory-utilization from ([0-9.]+) to ([0-9.]+)",
        "smi_gpu": r"^\|\s+[0-9]+\s+(NVIDIA [A-Za-z0-9 \-]+?)\s{2,}(?:On|Off)\s",
    }.items()
}
_ENGINE_FIELDS = {
    "model": r"with config: model='([^']*)'",
    "max_seq_len": r"max_seq_len=([0-9]+)",
    "tensor_parallel_size": r"tensor_parallel_size=([0-9]+)",
    "pipeline_parallel_size": r"pipeline_parallel_size=([0-9]+)",
    "data_parallel_size": r"data_parallel_size=([0-9]+)",
    "enforce_eager": r"enforce_eager=(True|False)",
    "kv_cache_dtype": r"kv_cache_dtype=([A-Za-z0-9_]+)",
    "enable_prefix_caching": r"enable_prefix_caching=(True|False)",
    "dtype": r"dtype=torch\.([a-z0-9]+)",
    "quantization": r"quantization=([A-Za-z0-9_]+)",
    "cudagraph_capture_sizes": r"""['"]cudagraph_capture_sizes['"]: ?\[([0-9, ]*)\]""",
    "max_cudagraph_capture_size": r"""['"]max_(?:cudagraph_)?capture_size['"]: ?([0-9]+)""",
    "speculative_config": r"speculative_config=SpeculativeConfig\((method='[^']*', model='[^']*', "
    r"num_spec_tokens=[0-9]+)\)",
}
_ENGINE = {k: re.compile(v, re.ASCII) for k, v in _ENGINE_FIELDS.items()}
_PP_RANK = re.compile(r"PP([0-9]+)", re.ASCII)
_RANK = re.compile(r"rank=([0-9]+)", re.ASCII)


@dataclass
class LoggedStartup:
    """What one start-up log says. Sizes in GiB as printed; None where the log is silent."""

    version: str | None = None
    model: str | None = None
    args: dict[str, Any] = field(default_factory=dict)  # the non-default args vLLM printed
    engine: dict[str, Any] = field(default_factory=dict)  # fields of the engine config line
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    async_logged: bool = False
    weights_gib: float | None = None  # largest "Model loading took" of any worker
    available_gib: dict[str, float] = field(default_factory=dict)  # worker -> "Available KV cache memory"
    kv_tokens: int | None = None
    concurrency: tuple[int, float] | None = None  # (max model len, max concurrency)
    free_gib: float | None = None
    total_gib: float | None = None
    mem_util: float | None = None
    requested_gib: float | None = None
    usage: dict[str, float] = field(default_factory=dict)  # the "Actual usage" breakdown
    graph_counts: tuple[int, int, int] | None = None  # PIECEWISE, largest, FULL
    full_largest: int | None = None  # the largest FULL (decode) graph: max_num_seqs when it is in the list
    graph_estimate_gib: float | None = None
    graph_actual_gib: float | None = None
    device: str | None = None  # a device name the log prints (fused-MoE config file, nvidia-smi)
    # (the --gpu-memory-utilization in effect, its equivalent with / without the CUDA-graph
    # estimate), as the graph line states them: their difference x total = the estimate
    util_pair: tuple[float, float] | None = None
    lines: int = 0
    recognised: int = 0

    def setting(self, key: str) -> Any:
        """A setting from the non-default args, else the engine config line, else None."""
        if key in self.args:
            return self.args[key]
        return self.engine.get(key)

    @property
    def missing(self) -> list[str]:
        """The figures a full start-up log shows that this one does not."""
        checks = {
            "vLLM version": self.version,
            "model": self.model,
            "max model len": self.max_model_len or self.setting("max_model_len"),
            "'Model loading took'": self.weights_gib,
            "'Available KV cache memory'": self.available_gib or None,
            "'GPU KV cache size'": self.kv_tokens,
            "'Maximum concurrency'": self.concurrency,
            "'Free memory on device' (GPU total and breakdown)": self.total_gib,
        }
        return [k for k, v in checks.items() if v is None]

    def stage_available_gib(self, pp: int, tp: int = 1) -> list[float]:
        """Available KV memory per pipeline stage (vLLM keeps each stage's workers apart;
        within a stage the smallest worker's figure, as the engine does). A worker's stage
        is its `PPn` label, else its global rank // tp."""
        if not self.available_gib:
            return []
        by_stage: dict[int, list[float]] = {}
        for worker, gib in self.available_gib.items():
            m, r = _PP_RANK.search(worker), _RANK.search(worker)
            stage = int(m.group(1)) if m else (int(r.group(1)) // max(1, tp) if r else -1)
            by_stage.setdefault(stage, []).append(gib)
        if pp > 1 and -1 not in by_stage and len(by_stage) == pp:
            return [min(by_stage[k]) for k in sorted(by_stage)]
        values = list(dict.fromkeys(self.available_gib.values()))
        if pp > 1 and len(values) == pp:
            return values  # one figure per stage, in rank order
        return [min(values)] * max(1, pp)


def _num(text: str) -> float:
    return float(text.replace(",", ""))


MAX_ARGS_CHARS = 200_000  # a non-default args dict longer than this is not read


def _literal_dict(text: str) -> dict[str, Any]:
    if len(text) > MAX_ARGS_CHARS:
        return {}
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        value = None
    if isinstance(value, dict):
        return {str(k): v for k, v in value.items()}
    out: dict[str, Any] = {}  # a dict with non-literal values: read the plain ones
    for m in re.finditer(r"'([a-z_]+)': ('[^']*'|[0-9.]+|True|False|None)", text, re.ASCII):
        try:
            out[m.group(1)] = ast.literal_eval(m.group(2))
        except (ValueError, SyntaxError):
            continue
    return out


def _engine_line(line: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, pattern in _ENGINE.items():
        m = pattern.search(line)
        if m is None:
            continue
        v = m.group(1)
        if key == "speculative_config":
            found = re.findall(r"([a-z_]+)=(?:'([^']*)'|([0-9]+))", v, re.ASCII)
            parts = {name: text or number for name, text, number in found}
            out[key] = {
                "method": parts.get("method"),
                "model": parts.get("model"),
                "num_speculative_tokens": int(parts.get("num_spec_tokens") or 0),
            }
        elif key == "cudagraph_capture_sizes":
            out[key] = [int(x) for x in v.replace(" ", "").split(",") if x]
        elif v in ("True", "False"):
            out[key] = v == "True"
        elif v == "None":
            out[key] = None
        elif v.isdigit():
            out[key] = int(v)
        else:
            out[key] = v
    return out


def parse_log(text: str) -> LoggedStartup:
    """Everything `text` (a vLLM start-up log) says about the server's memory."""
    log = LoggedStartup()
    for line in text.splitlines():
        log.lines += 1
        if "Initializing a V1 LLM engine" in line or "with config: model=" in line:
            log.engine.update(_engine_line(line))
            m = _PATTERNS["version_engine"].search(line)
            if m:
                log.version = log.version or m.group(1)
            log.recognised += 1
            continue
        hit = _match_line(log, line)
        log.recognised += hit
    if log.model is None:
        log.model = log.args.get("model") or log.args.get("model_tag") or log.engine.get("model")
    return log


def _match_line(log: LoggedStartup, line: str) -> bool:  # noqa: C901 - one branch per line kind
    p = _PATTERNS
    if "non-default args" in line and (m := p["non_default"].search(line)):
        log.args.update(_literal_dict(m.group(1)))
    elif "version" in line and (m := p["version_api"].search(line) or p["version_banner"].search(line)):
        log.version = log.version or m.group(1)
    elif "model " in line and "█" in line and (m := p["banner_model"].search(line)):
        log.model = log.model or m.group(1)
    elif "Using max model len" in line and (m := p["max_model_len"].search(line)):
        log.max_model_len = int(m.group(1))
    elif "Chunked prefill is enabled" in line and (m := p["chunked"].search(line)):
        log.max_num_batched_tokens = int(m.group(1))
    elif p["async_on"].search(line):
        log.async_logged = True
    elif "Model loading took" in line and (m := p["weights"].search(line)):
        log.weights_gib = max(log.weights_gib or 0.0, _num(m.group(1)))
    elif "Available KV cache memory" in line and (m := p["available"].search(line)):
        w = _WORKER.search(line)
        log.available_gib[w.group(1) if w else f"line {log.lines}"] = _num(m.group(1))
    elif "KV cache size" in line and (m := p["kv_tokens"].search(line)):
        log.kv_tokens = int(_num(m.group(1)))
        if c := p["concurrency"].search(line):  # 0.20+ prints both on one line
            log.concurrency = (int(_num(c.group(1))), _num(c.group(2)))
    elif "Maximum concurrency for" in line and (m := p["concurrency"].search(line)):
        log.concurrency = (int(_num(m.group(1))), _num(m.group(2)))
    elif "Free memory on device" in line and (m := p["free"].search(line)):
        log.free_gib, log.total_gib = _num(m.group(1)), _num(m.group(2))
        log.mem_util, log.requested_gib = _num(m.group(3)), _num(m.group(4))
        if u := p["old_usage"].search(line):
            log.usage = dict(zip(("weights", "peak activation", "non-torch", "CUDA graphs"), map(_num, u.groups())))
        elif u := p["new_usage"].search(line):
            log.usage = dict(zip(("consumed", "peak activation", "CUDA graphs"), map(_num, u.groups())))
    elif "Profiling CUDA graph memory" in line and (m := p["graph_counts"].search(line)):
        log.graph_counts = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        log.full_largest = int(m.group(4)) if m.group(4) else None
    elif "Estimated CUDA graph memory" in line and (m := p["graph_estimate"].search(line)):
        log.graph_estimate_gib = _num(m.group(1))
    elif "Graph capturing finished" in line and (m := p["graph_actual"].search(line)):
        log.graph_actual_gib = max(log.graph_actual_gib or 0.0, _num(m.group(1)))
    elif "device_name=" in line and (m := p["device"].search(line)):
        log.device = log.device or m.group(1).replace("_", " ")
    elif "gpu-memory-utilization" in line and (m := p["util_equiv"].search(line)):
        log.util_pair = (float(m.group(1)), float(m.group(2)))
    elif "gpu-memory-utilization from" in line and (m := p["util_from_to"].search(line)):
        log.util_pair = (float(m.group(1)), float(m.group(2)))
    elif line.startswith("|") and "NVIDIA" in line and (m := p["smi_gpu"].search(line)):
        log.device = log.device or m.group(1).strip()
    else:
        return False
    return True
