"""`quantize MODEL --model-free`: a data-free scheme applied to a checkpoint's safetensors
shards, tensor by tensor, without building the model (any architecture, any size).

Steps: read every shard's header (names, dtypes, shapes); choose the tensors to quantize by
name (`jobs/model_free_select.py`); for each input shard, in name order, read one tensor,
dequantize it when the source is native FP8 (block `weight_scale_inv` or per-tensor
`weight_scale`), quantize it (`jobs/model_free_formats.TensorCodec`: the pipeline's solvers
and format writers) or keep it, and append the result to the output shard of the same name
(`packers/safetensors_sequential.py`); an NVFP4 fused group (q/k/v, gate/up, one expert's
w1/w3) shares the global scale of all its shards, read from wherever they are. Then
config.json with the `quantization_config`, the index, every other file of the source copied
byte for byte (tokenizer, chat template, generation config, custom code: never imported),
and the report; the directory is renamed into `--out` at the end.

Memory: one tensor at a time, its float32 copy and its quantized tensors, plus the next tensor
(read meanwhile) and the previous output (written meanwhile) (a 3-D expert tensor is quantized
expert by expert; the members of an NVFP4 fused group in the same shard are held until they are
written), so the peak is a few times the largest tensor (or fused group) plus
the interpreter, with glibc's mmap threshold fixed so that freed tensors leave no heap behind
(`fixed_mmap_threshold`). Progress: each finished
shard is renamed into `.{out}.partial/` beside `--out`; `--resume` keeps those and continues
(refused when the source or the options differ). This module does not print.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.common.progress import Progress, no_progress
from infer_tool.jobs.model_free_select import Selection, group_members, module_of
from infer_tool.schemes.base import SCALE_DTYPES, Scheme

STATE = "model-free.json"
VERSION = 1
MB = 10**6
WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".safetensors")


@dataclass
class ModelFreeOptions:
    model: str
    out: str
    scheme: Scheme
    ignore: tuple[str, ...] = ()
    default_ignore: bool = True
    dtype: str = "auto"
    resume: bool = False


@dataclass
class ModelFreeReport:
    model: str
    out: str
    method: str
    scheme: str
    format: str
    quantized: int  # tensors quantized (a 3-D expert tensor counts once)
    kept: int  # floating weights of 2+ dimensions kept as they were
    ignore: list[str]  # the config's ignore list (modules left unquantized)
    skipped: dict[str, str]  # module -> why a targeted weight was kept (its shape)
    source_quantization: str | None  # "fp8 block 128x128", "fp8 tensor" or None
    shards: int
    resumed_shards: int
    bytes_in: int
    bytes_out: int
    seconds: float
    mb_per_s: float  # input bytes processed by this run per second
    peak_rss_mib: float
    unmatched_ignore: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Source:
    """A checkpoint directory as its shard headers describe it."""

    path: Path
    config: dict[str, Any]
    files: list[str]  # shard file names, in order
    where: dict[str, str]  # tensor name -> file
    headers: dict[str, dict[str, dict[str, Any]]]  # file -> {tensor: header entry}
    starts: dict[str, int]  # file -> where its offsets count from

    def info(self, name: str) -> dict[str, Any]:
        return self.headers[self.where[name]][name]

    def nbytes(self, name: str) -> int:
        begin, end = self.info(name)["data_offsets"]
        return int(end) - int(begin)


def open_source(path: Path) -> Source:
    """The shards of `path` (its index's files, else every *.safetensors) and their headers."""
    from infer_tool.common.safetensors_header import tensor_headers
    from infer_tool.packers.shards import SAFETENSORS_INDEX

    config = json.loads((path / "config.json").read_text())
    if not isinstance(config, dict):
        raise BadInput(f"{path / 'config.json'} is not a JSON object")
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise BadInput(f"{index} is not a safetensors index (no weight_map)") from None
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise BadInput(f"{path} holds no .safetensors shards; --model-free reads safetensors only")
    where: dict[str, str] = {}
    headers, starts = {}, {}
    for f in files:
        if "/" in f or not (path / f).is_file():
            raise BadInput(f"the index of {path} names a shard {f!r} that is not a file there")
        header, start = tensor_headers(path / f)
        headers[f], starts[f] = header, start
        for name in header:
            if name in where:
                raise BadInput(f"tensor {name!r} is in both {where[name]} and {f}")
            where[name] = f
    return Source(path, config, files, where, headers, starts)


def checkpoint_dtype(requested: str, config: Mapping[str, Any]) -> str:
    """--dtype, or the source config's dtype (float32 when it names none), as the pipeline's."""
    if requested != "auto":
        if requested not in SCALE_DTYPES:
            raise BadInput(f"unknown --dtype {requested!r}: expected auto, {', '.join(SCALE_DTYPES)}")
        return requested
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    name = str(config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype") or "")
    name = name.removeprefix("torch.")
    return name if name in SCALE_DTYPES else "float32"


# ---------------------------------------------------------------- the plan


@dataclass
class Unit:
    """One input tensor to write: kept, or quantized as `module` (with its FP8 scale companion)."""

    name: str
    quantize: bool
    scale: str | None = None  # the native FP8 scale tensor read with it


@dataclass
class Plan:
    units: dict[str, list[Unit]]  # output shard -> units, in name order
    targets: list[str]  # quantized modules
    kept: list[str]  # modules of floating 2+-D weights kept
    skipped: dict[str, str]
    dropped: list[str]  # FP8 input scales no longer meaningful
    fp8_block: tuple[int, int] | None


FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def make_plan(src: Source, selection: Selection, codec: Any, fp8_block: tuple[int, int] | None) -> Plan:
    companions: dict[str, str] = {}  # weight name -> its FP8 scale tensor
    dropped: list[str] = []
    if fp8_block is not None:
        for name in src.where:
            info = src.info(name)
            if info["dtype"] != "F8_E4M3":
                continue
            if not name.endswith(".weight") or len(info["shape"]) != 2:
                raise BadInput(f"FP8 tensor {name!r} {info['shape']} is not a 2-D .weight; it cannot be dequantized")
            scale = name + ("_scale_inv" if fp8_block != (0, 0) else "_scale")
            if scale not in src.where:
                raise BadInput(f"the FP8 source has {name} but no {scale}")
            companions[name] = scale
        dropped = sorted(
            n
            for n in src.where
            if n.endswith((".input_scale", ".activation_scale")) and f"{n.rsplit('.', 1)[0]}.weight" in companions
        )
    consumed = set(companions.values()) | set(dropped)
    units: dict[str, list[Unit]] = {f: [] for f in src.files}
    targets, kept, skipped = [], [], {}
    for name in sorted(src.where):
        if name in consumed:
            continue
        info = src.info(name)
        shape = [int(d) for d in info["shape"]]
        floating = info["dtype"] in FLOAT_DTYPES
        quantize = selection.is_target(name, shape, floating)
        module = module_of(name)
        if quantize:
            why = codec.shape_refusal(shape[-2], shape[-1])
            if why is not None:
                skipped[module], quantize = why, False
        if quantize:
            targets.append(module)
        elif floating and len(shape) >= 2:
            kept.append(module)
        units[src.where[name]].append(Unit(name, quantize, companions.get(name)))
    return Plan(units, targets, kept, skipped, dropped, fp8_block)


def config_ignore(plan: Plan) -> list[str]:
    """The modules vLLM and transformers must leave unquantized: every kept weight of 2+
    dimensions but the embeddings (not linears), and lm_head (tied ones are not stored)."""
    import re

    from infer_tool.jobs.model_free_select import DEFAULT_IGNORE

    embeddings = DEFAULT_IGNORE[0]
    out = {m for m in plan.kept if not re.search(embeddings, m)}
    if not any(m == "lm_head" or m.endswith(".lm_head") for m in plan.targets):
        out.add("lm_head")
    return sorted(out)


# ---------------------------------------------------------------- reading


class Reader:
    """Tensors of the source, one at a time, dequantized from native FP8 and cast to the
    checkpoint dtype where they are floating."""

    def __init__(self, src: Source, plan: Plan, dtype: Any):
        self.src, self.plan, self.dtype = src, plan, dtype
        self.scale_of = {u.name: u.scale for us in plan.units.values() for u in us if u.scale}

    def raw(self, name: str) -> Any:
        from infer_tool.packers.safetensors_stream import read_tensors

        return read_tensors(self.src.path / self.src.where[name], [name])[name]

    def weight(self, name: str) -> Any:
        """The tensor `name` as the checkpoint stores it (floating: in the checkpoint dtype)."""
        from infer_tool.jobs.model_free_formats import dequantize_fp8

        t = self.raw(name)
        scale = self.scale_of.get(name)
        if scale is not None:
            return dequantize_fp8(t, self.raw(scale), self.plan.fp8_block, self.dtype)
        return t.to(self.dtype) if t.is_floating_point() and t.dtype != self.dtype else t

    def bytes_of(self, unit: Unit) -> int:
        return self.src.nbytes(unit.name) + (self.src.nbytes(unit.scale) if unit.scale else 0)


class GlobalScales:
    """NVFP4 global scales per fused group (and per expert of a 3-D group), computed from
    every member's weight when the first member is written; members read for it that come
    later in the same shard are held (`held`) until their turn."""

    def __init__(self, codec: Any, plan: Plan, reader: Reader):
        self.codec, self.reader = codec, reader
        self.targets = plan.targets
        self.name_of = {module_of(u.name): u.name for us in plan.units.values() for u in us if u.quantize}
        self.known: dict[tuple[str, int | None], Any] = {}
        self.held: dict[str, Any] = {}

    def of(self, module: str, weight: Any, expert: int | None, shard: str, done: set[str]) -> Any:
        if not self.codec.shares_global_scale:
            return None
        if (module, expert) not in self.known:
            members = group_members(module, self.targets)
            weights = {}
            for m in members:
                name = self.name_of[m]
                if m == module:
                    weights[m] = weight
                elif name in self.held:
                    weights[m] = self.held[name]
                else:
                    w = self.reader.weight(name)
                    weights[m] = w
                    if self.reader.src.where[name] == shard and name not in done:
                        self.held[name] = w
            if weight.dim() == 3:
                for e in range(weight.shape[0]):
                    gs = self.codec.global_scale([weights[m][e] for m in members])
                    self.known.update({(m, e): gs for m in members})
            else:
                gs = self.codec.global_scale([weights[m] for m in members])
                self.known.update({(m, None): gs for m in members})
        return self.known[(module, expert)]

    def take(self, name: str) -> Any | None:
        return self.held.pop(name, None)

    def holds(self, name: str) -> bool:
        return name in self.held


# ---------------------------------------------------------------- the run


def run_key(src: Source, opts: ModelFreeOptions, dtype_name: str) -> str:
    from infer_tool.jobs.run_dir import model_fingerprint

    doc = {
        "version": VERSION,
        "model": model_fingerprint(src.path),
        "scheme": opts.scheme.to_dict(),
        "dtype": dtype_name,
        "ignore": list(opts.ignore),
        "default_ignore": opts.default_ignore,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def check_partial(out: str, resume: bool) -> Path:
    """The progress directory beside `out`; refused when it holds progress and `resume` is off,
    or when it is not a model-free run's."""
    from infer_tool.jobs.run_dir import partial_dir

    path = partial_dir(out)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise BadInput(f"{path} is where the progress of --out {out!r} is kept, but it is not a directory; move it")
    if path.exists() and not resume:
        done = len([p for p in path.glob("*.safetensors")])
        raise BadInput(
            f"{path} holds the progress of an interrupted run ({done} shards done); pass --resume to continue it, "
            "or delete that directory to start over"
        )
    if path.exists() and resume and not (path / STATE).is_file():
        raise BadInput(f"{path} holds the progress of a run that is not a --model-free one; delete it to start over")
    return path


def check(opts: ModelFreeOptions, overwrite: bool, first: bool = True) -> Path:
    """Checks before any tensor is read: the scheme, --out, the progress (by the first process
    only: the others join the progress it opens); returns the model directory."""
    from infer_tool.calib.models import resolve_model_dir
    from infer_tool.jobs.model_free_formats import refusal
    from infer_tool.packers.checkpoint import check_checkpoint_out

    why = refusal(opts.scheme)
    if why:
        raise BadInput(
            f"--model-free runs data-free schemes only (every format's RTN without static activations): {why}"
        )
    from infer_tool.jobs.quantize import check_patterns

    check_patterns(opts.ignore)
    path, _ = resolve_model_dir(opts.model)
    check_checkpoint_out(opts.out, overwrite=overwrite, src_dir=path)
    if first:
        check_partial(opts.out, opts.resume)
    return path


def launch_rank() -> tuple[int, int]:
    """(rank, world size) from `torchrun`'s environment; (0, 1) without a launcher."""
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    if not (rank.isascii() and rank.isdigit() and world.isascii() and world.isdigit()) or int(rank) >= int(world):
        raise BadInput(f"RANK={rank!r} and WORLD_SIZE={world!r} are not a process rank below a process count")
    return int(rank), int(world)


def assign_shards(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """{shard: the process that writes it}: largest first, each to the least loaded process
    (ties: the lower rank), so every process gets about the same bytes."""
    load = [0] * world
    owner = {}
    for shard in sorted(sizes, key=lambda f: (-sizes[f], f)):
        r = min(range(world), key=lambda i: (load[i], i))
        owner[shard] = r
        load[r] += sizes[shard]
    return owner


def quantize_model_free(
    opts: ModelFreeOptions,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
    rank: int | None = None,
    world: int | None = None,
) -> ModelFreeReport:
    """Quantize `opts.model`'s shards into `opts.out` (module docstring); returns the report.

    Under several processes (`torchrun --nproc-per-node N`, or `rank` / `world` given), each
    writes its share of the shards (`assign_shards`) into the progress directory process 0
    opened; process 0 waits for all of them, then writes the index, config and report and
    renames the directory into `--out`. The bytes are those of one process."""
    import torch

    from infer_tool.jobs.model_free_formats import FORMAT_NAME, TensorCodec, fp8_source

    started = time.perf_counter()
    joined_after = time.time()
    if rank is None or world is None:
        rank, world = launch_rank()
    progress = progress or no_progress
    path = check(opts, overwrite, first=rank == 0)
    fixed_mmap_threshold()
    src = open_source(path)
    fp8_block = fp8_source(src.config.get("quantization_config"))
    dtype_name = checkpoint_dtype(opts.dtype, src.config)
    codec = TensorCodec.open(opts.scheme, dtype_name)
    selection = Selection.of(src.config, opts.ignore, opts.default_ignore)
    plan = make_plan(src, selection, codec, fp8_block)
    if not plan.targets:
        raise BadInput(f"no tensor of {opts.model} is quantized: every 2-D weight is kept by the ignore patterns")
    unmatched = selection.unmatched_user_patterns(plan.targets + plan.kept + list(plan.skipped))
    key = run_key(src, opts, dtype_name)
    work = _open_work(opts.out, key, world) if rank == 0 else _join_work(opts.out, key, world, joined_after)
    dtype = getattr(torch, dtype_name)
    reader = Reader(src, plan, dtype)
    scales = GlobalScales(codec, plan, reader)
    sizes = {shard: sum(reader.bytes_of(u) for u in plan.units[shard]) for shard in src.files}
    owner = assign_shards(sizes, world)
    total = sum(sizes.values())
    done_bytes = resumed_bytes = resumed = 0
    run_started = time.perf_counter()
    progress("model-free MB", 0, max(1, total // MB))
    for shard in src.files:
        if owner[shard] != rank:
            continue
        if (work / shard).is_file():  # finished by an earlier run
            resumed += 1
            resumed_bytes += sizes[shard]
            done_bytes += sizes[shard]
            continue
        _write_shard(work, shard, plan.units[shard], reader=reader, codec=codec, scales=scales, src=src)
        done_bytes += sizes[shard]
        elapsed = max(time.perf_counter() - run_started, 1e-9)
        mine = sum(sizes[f] for f in src.files if owner[f] == rank)
        progress(
            "model-free MB", done_bytes // MB, max(1, mine // MB), MB_s=(done_bytes - resumed_bytes) / MB / elapsed
        )
    if rank != 0:
        return _rank_report(
            opts, codec, plan, src=src, written=done_bytes - resumed_bytes, started=started, run_started=run_started
        )
    while not all((work / f).is_file() for f in src.files):  # the other processes' shards
        time.sleep(0.2)
    ignore = config_ignore(plan)
    ignore = config_ignore(plan)
    config = dict(src.config)
    config["quantization_config"] = codec.config(ignore)
    config["dtype"] = dtype_name
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype_name
    bytes_out = _finish(work, src, config)
    seconds = time.perf_counter() - started
    notes = []
    if plan.dropped:
        notes.append(f"{len(plan.dropped)} static FP8 input scales of the source were dropped (dynamic activations)")
    if plan.skipped:
        notes.append(f"{len(plan.skipped)} weights kept whose shape the scheme cannot group (see skipped)")
    if resumed:
        notes.append(f"resumed: {resumed} of {len(src.files)} shards were finished by an earlier run")
    report = ModelFreeReport(
        model=opts.model,
        out=str(opts.out),
        method=opts.scheme.method,
        scheme=codec.describe(),
        format=f"{FORMAT_NAME} ({codec.config(())['format']})",
        quantized=len(plan.targets),
        kept=len(plan.kept),
        ignore=ignore,
        skipped=plan.skipped,
        source_quantization=None
        if fp8_block is None
        else ("fp8 tensor" if fp8_block == (0, 0) else f"fp8 block {fp8_block[0]}x{fp8_block[1]}"),
        shards=len(src.files),
        resumed_shards=resumed,
        bytes_in=total,
        bytes_out=bytes_out,
        seconds=seconds,
        mb_per_s=(total - resumed_bytes) / MB / max(time.perf_counter() - run_started, 1e-9),  # all processes
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        unmatched_ignore=unmatched,
        notes=notes,
    )
    _publish(work, Path(opts.out), report)
    return report


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 2**20


def fixed_mmap_threshold() -> None:
    """Allocations of 1 MiB and more get their own memory maps, returned to the system when
    freed. glibc raises its threshold (up to 32 MiB) each time such a block is freed, after
    which a tensor's float32 copies and intermediates come from the heap, which it rarely
    shrinks: tensor after tensor the RSS would creep up. Setting the threshold fixes it (a
    no-op where the C library is not glibc)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except OSError:
        return


WORLD = "world.json"  # process 0's word to the others: the run's key, the process count, when
JOIN_TIMEOUT_S = 3600.0


def _join_work(out: str, key: str, world: int, after: float) -> Path:
    """The progress directory process 0 opened for this run (its WORLD record names this key
    and process count, written after this process started, give or take a minute)."""
    from infer_tool.jobs.run_dir import partial_dir

    work = partial_dir(out)
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            doc = json.loads((work / WORLD).read_text())
        except (OSError, ValueError):
            doc = None
        if isinstance(doc, dict) and doc.get("key") == key and doc.get("world") == world:
            if float(doc.get("time", 0)) >= after - 60:
                return work
        time.sleep(0.2)
    raise BadInput(f"process 0 did not open {work} for this run within {JOIN_TIMEOUT_S:.0f}s (see its error)")


def _rank_report(
    opts: ModelFreeOptions, codec: Any, plan: Plan, *, src: Source, written: int, started: float, run_started: float
) -> ModelFreeReport:
    """What a process other than 0 did (process 0 reports the run)."""
    return ModelFreeReport(
        model=opts.model,
        out=str(opts.out),
        method=opts.scheme.method,
        scheme=codec.describe(),
        format=codec.config(())["format"],
        quantized=len(plan.targets),
        kept=len(plan.kept),
        ignore=[],
        skipped=plan.skipped,
        source_quantization=None,
        shards=len(src.files),
        resumed_shards=0,
        bytes_in=written,
        bytes_out=0,
        seconds=time.perf_counter() - started,
        mb_per_s=written / MB / max(time.perf_counter() - run_started, 1e-9),
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )


def _open_work(out: str, key: str, world: int = 1) -> Path:
    """The progress directory, created or (resuming) checked against `key`; leftovers of a
    killed shard write are removed."""
    from infer_tool.jobs.run_dir import partial_dir

    work = partial_dir(out)
    state = work / STATE
    if work.is_dir():
        try:
            found = json.loads(state.read_text()).get("key")
        except (OSError, ValueError, AttributeError):
            found = None
        if found != key:
            raise BadInput(
                f"{work} holds the progress of a --model-free run of another source or other options; "
                "delete it to start over"
            )
        (work / WORLD).unlink(missing_ok=True)  # a killed run's word to its processes
        for tmp in work.glob("*.tmp"):
            tmp.unlink()
    else:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        tmp = work.with_name(work.name + ".new")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        (tmp / STATE).write_text(json.dumps({"key": key, "version": VERSION}) + "\n")
        tmp.rename(work)
    record = work / f"{WORLD}.tmp"
    record.write_text(json.dumps({"key": key, "world": world, "time": time.time()}) + "\n")
    record.rename(work / WORLD)
    return work


def _outputs(unit: Unit, codec: Any, shape: list[int]) -> list[tuple[str, int]]:
    """(name, rank) of the tensors a unit may write: the header's reservation."""
    if not unit.quantize:
        return [(unit.name, len(shape))]
    module = module_of(unit.name)
    return [(f"{module}.{s}", len(shape) + 1) for s in codec.fmt.suffixes]


def _write_shard(
    work: Path, shard: str, units: list[Unit], *, reader: Reader, codec: Any, scales: Any, src: Source
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from infer_tool.packers.safetensors_sequential import SequentialWriter, reserve
    from infer_tool.packers.shards import METADATA

    entries = [e for u in units for e in _outputs(u, codec, src.info(u.name)["shape"])]
    tmp = work / f"{shard}.tmp"
    writer = SequentialWriter(tmp, reserve(entries, METADATA), METADATA)
    done: set[str] = set()

    def write(tensors: list[tuple[str, Any]]) -> None:
        for k, t in tensors:
            writer.add(k, t)

    # The next unit is read and the previous one written while this one is quantized (file I/O
    # and torch release the GIL): one tensor in flight each way, in order, so the bytes are the
    # same as one after the other.
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="model-free-io")
    try:
        ahead = pool.submit(reader.weight, units[0].name) if units else None
        behind = None
        for i, u in enumerate(units):
            w = scales.take(u.name)  # read already for a fused group's global scale
            if w is None:
                w = ahead.result()
            module = module_of(u.name)
            if u.quantize:  # global scales first: they may read (and hold) later members of this shard
                experts = [None] if w.dim() == 2 else list(range(w.shape[0]))
                shared = [scales.of(module, w, e, shard, done) for e in experts]
            nxt = units[i + 1].name if i + 1 < len(units) else None
            ahead = pool.submit(reader.weight, nxt) if nxt is not None and not scales.holds(nxt) else None
            if not u.quantize:
                out = {u.name: w}
            elif w.dim() == 2:
                out = codec.quantize(module, w, shared[0])
            else:  # (E, N, K): expert by expert, stacked
                per = [codec.quantize(module, w[e], shared[e]) for e in experts]
                out = {k: torch.stack([p[k] for p in per]) for k in per[0]}
            if behind is not None:
                behind.result()
            behind = pool.submit(write, [(k, out[k]) for k in sorted(out)])
            done.add(u.name)
            del w, out
        if behind is not None:
            behind.result()
        writer.close()
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        writer.abort()
        tmp.unlink(missing_ok=True)
        raise
    finally:
        pool.shutdown(wait=True)
    tmp.rename(work / shard)


def write_index(work: Path, src: Source) -> int:
    """The index of the shards in `work` (several shards, or a source that had one), named as
    the source's; returns the shards' bytes."""
    from infer_tool.common.safetensors_header import tensor_headers
    from infer_tool.packers.shards import SAFETENSORS_INDEX

    weight_map, total_size, size = {}, 0, 0
    for shard in src.files:
        header, _ = tensor_headers(work / shard)
        for name, info in header.items():
            weight_map[name] = shard
            total_size += int(info["data_offsets"][1]) - int(info["data_offsets"][0])
        size += (work / shard).stat().st_size
    if len(src.files) > 1 or (src.path / SAFETENSORS_INDEX).is_file():
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (work / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return size


def _finish(work: Path, src: Source, config: dict[str, Any]) -> int:
    """The index, config.json and the source's other files; returns the shards' bytes."""
    size = write_index(work, src)
    (work / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    copy_other_files(src.path, work)
    return size


def copy_other_files(src: Path, dst: Path) -> None:
    """Every file of the source but its weights, index, config and dot-files, byte for byte."""
    from infer_tool.packers.checkpoint import REPORT_NAME
    from infer_tool.packers.shards import SAFETENSORS_INDEX

    skip = {"config.json", SAFETENSORS_INDEX, REPORT_NAME}
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel = Path(root).relative_to(src)
        for f in sorted(files):
            if f.startswith(".") or f.endswith(WEIGHT_SUFFIXES) or (rel == Path(".") and f in skip):
                continue
            target = dst / rel / f
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(root) / f, target)


def _publish(work: Path, out: Path, report: ModelFreeReport) -> None:
    from infer_tool.common.jsonout import to_json
    from infer_tool.packers.checkpoint import REPORT_NAME, publish

    (work / STATE).unlink()
    (work / WORLD).unlink(missing_ok=True)
    doc = json.loads(to_json(asdict(report)))
    doc["model_free"] = True
    (work / REPORT_NAME).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    publish(work, out)
