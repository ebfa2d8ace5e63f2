"""`infer-tool convert SRC --to compressed-tensors`: a checkpoint another tool wrote (AutoAWQ's
GEMM, GPTQ v1, native FP8 per tensor or per block, ModelOpt NVFP4) rewritten as compressed-tensors,
linear by linear, without the model class and without rounding anything again.

Each source linear is read by its format's reader (`packers/`, through
`jobs/model_free_formats.conversion`) into the canonical weight (integer codes, scales, zero
points; or e4m3 values and scales) and written by the compressed-tensors writer: the codes are
the same codes, the scales the same values in the same dtype (float16 for AWQ / GPTQ, float32
for FP8), so the dequantized weights are equal bit for bit. What compressed-tensors cannot
carry is refused naming why (GPTQ act-order whose g_idx reorders groups). ModelOpt NVFP4 keeps
its codes and E4M3 block scales byte for byte; its global multiplier becomes compressed-tensors'
divisor, exact where float32 allows (`packers/codecs/modelopt_nvfp4.py`; the report's notes count
where). A legacy ModelOpt export's hf_quant_config.json is read and not copied. Every other tensor
is copied as it is; output shards keep the source's names; the other files are copied
byte for byte (`jobs/model_free.py`'s rules).

Back (`--to awq | gptq | fp8`): a compressed-tensors checkpoint rewritten as AutoAWQ GEMM (4-bit
groups), GPTQ v1 (2/4/8-bit groups or channels, symmetric or not) or native FP8 (per tensor or
per block) by the same path, the compressed-tensors reader feeding that format's writer; what
the target cannot carry (a scale float16 does not hold, a zero point of 0 in GPTQ, per-channel
FP8, FP4 codes, mixed precision) is refused naming why. This module does not print.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.common.progress import Progress, no_progress
from infer_tool.jobs.model_free import FLOAT_DTYPES, MB, Source, copy_other_files, open_source, write_index


@dataclass
class ConvertReport:
    model: str
    out: str
    source_format: str
    format: str
    scheme: str
    linears: int
    ignore: list[str]
    shards: int
    bytes_in: int
    bytes_out: int
    seconds: float
    notes: list[str] = field(default_factory=list)


def _source_ignore(qcfg: dict[str, Any]) -> list[str]:
    """The source's own list of unquantized modules, names only (ModelOpt's wildcards are left
    out: the kept float linears are listed by name anyway)."""
    out = []
    for key in ("modules_to_not_convert", "ignored_layers", "ignore"):
        v = qcfg.get(key)
        if isinstance(v, list):
            out += [str(x) for x in v if "*" not in str(x)]
    return out


def convert(
    model: str, out: str, *, to: str = "compressed-tensors", overwrite: bool = False, progress: Progress | None = None
) -> ConvertReport:
    """Convert checkpoint `model` into `out` (module docstring); returns the report."""
    from infer_tool.calib.models import resolve_model_dir
    from infer_tool.jobs.model_free_formats import TARGETS, conversion
    from infer_tool.jobs.model_free_select import DEFAULT_IGNORE
    from infer_tool.packers.checkpoint import check_checkpoint_out
    from infer_tool.packers.codecs.modelopt_config import HF_QUANT_CONFIG, hf_quant_config

    started = time.perf_counter()
    progress = progress or no_progress
    if to not in TARGETS:
        raise BadInput(f"--to {to!r} is not supported; use --to {', '.join(TARGETS)}")
    path, _ = resolve_model_dir(model)
    check_checkpoint_out(out, overwrite=overwrite, src_dir=path)
    src = open_source(path)
    qcfg = src.config.get("quantization_config") or hf_quant_config(path)
    conv = conversion(qcfg, to)
    anchors = {}  # module -> anchor tensor name
    for name in src.where:
        module, _, suffix = name.rpartition(".")
        if suffix == conv.anchor and (conv.anchor != "weight" or src.info(name)["dtype"] == "F8_E4M3"):
            anchors[module] = name
    if not anchors:
        raise BadInput(f"{model} holds no {conv.source.name} linears (no *.{conv.anchor} tensors)")
    owned = {f"{m}.{s}": m for m in anchors for s in conv.suffixes if f"{m}.{s}" in src.where}
    embeddings = DEFAULT_IGNORE[0]
    kept = {
        n.removesuffix(".weight")
        for n in src.where
        if n not in owned
        and n.endswith(".weight")
        and len(src.info(n)["shape"]) == 2
        and src.info(n)["dtype"] in FLOAT_DTYPES
        and not re.search(embeddings, n.removesuffix(".weight"))
    }
    ignore = sorted(kept | {"lm_head"} | (set(_source_ignore(qcfg)) - set(anchors)))
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.parent / f".{out_path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        total = sum(src.nbytes(n) for n in src.where)
        done = 0
        for shard in src.files:
            _write_shard(tmp, shard, src, conv, owned, anchors)
            done += sum(src.nbytes(n) for n, f in src.where.items() if f == shard)
            progress("convert MB", done // MB, max(1, total // MB))
        config = dict(src.config)
        config["quantization_config"] = conv.config(ignore)
        bytes_out = write_index(tmp, src)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        copy_other_files(src.path, tmp)
        (tmp / HF_QUANT_CONFIG).unlink(missing_ok=True)  # ModelOpt's config would contradict config.json
        report = ConvertReport(
            model=model,
            out=str(out),
            source_format=conv.source.name,
            format=target_label(to, config["quantization_config"]),
            scheme=conv.scheme.describe(),
            linears=len(anchors),
            ignore=ignore,
            shards=len(src.files),
            bytes_in=total,
            bytes_out=bytes_out,
            seconds=time.perf_counter() - started,
            notes=conv.notes(),
        )
        _publish(tmp, out_path, report)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def target_label(to: str, qcfg: dict[str, Any]) -> str:
    """What the report calls the written format."""
    if to == "compressed-tensors":
        return f"compressed-tensors ({qcfg['format']})"
    if to == "fp8":
        block = qcfg.get("weight_block_size")
        return f"native fp8 ({'block ' + 'x'.join(map(str, block)) if block else 'per tensor'})"
    return {"awq": "AutoAWQ GEMM", "gptq": "GPTQ v1"}[to]


def _write_shard(tmp: Path, shard: str, src: Source, conv: Any, owned: dict, anchors: dict) -> None:
    from infer_tool.packers.safetensors_sequential import SequentialWriter, reserve
    from infer_tool.packers.safetensors_stream import read_tensors
    from infer_tool.packers.shards import METADATA

    names = sorted(n for n, f in src.where.items() if f == shard)
    target_suffixes = conv.target.suffixes
    entries = []
    for n in names:
        if n in owned:
            if anchors[owned[n]] == n:
                entries += [(f"{owned[n]}.{s}", 2) for s in target_suffixes]
        else:
            entries.append((n, len(src.info(n)["shape"])))
    writer = SequentialWriter(tmp / shard, reserve(entries, METADATA), METADATA)
    try:
        for n in names:
            if n in owned:
                module = owned[n]
                if anchors[module] != n:
                    continue
                members = [m for m, mod in owned.items() if mod == module]
                tensors = {m: read_tensors(src.path / src.where[m], [m])[m] for m in members}
                out = conv.convert(module, tensors)
            else:
                out = read_tensors(src.path / shard, [n])
            for k in sorted(out):
                writer.add(k, out[k])
        writer.close()
    except BaseException:
        writer.abort()
        raise


def _publish(tmp: Path, out: Path, report: ConvertReport) -> None:
    from infer_tool.common.jsonout import to_json
    from infer_tool.packers.checkpoint import REPORT_NAME, publish

    doc = json.loads(to_json(asdict(report)))
    doc.update({"method": "convert", "converted_from": report.source_format})
    (tmp / REPORT_NAME).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    publish(tmp, out)
