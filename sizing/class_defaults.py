"""What a model's own config class in transformers supplies for a field its config.json
omits (`Qwen3Config().head_dim` is 128, `MixtralConfig().num_experts_per_tok` 2), read
without importing transformers (whose config modules import torch).

Two sources, in order:
- the installed transformers' source: `models/<dir>/configuration_<dir>.py` is parsed with
  `ast` (never executed); the class whose `model_type` matches gives its defaults, from its
  annotated class attributes (transformers >= 5) or its `__init__` keyword defaults (4.x);
- else `class_defaults.json`: the same defaults for the families this package sizes, written
  from transformers (a test checks it against the installed classes).

Only `SIZE_FIELDS` (the fields a size depends on) are returned, and only literal values
(numbers, strings, booleans, None, and arithmetic of numbers such as `4096 * 32`).
"""

from __future__ import annotations

import ast
import importlib.util
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

TABLE = Path(__file__).with_name("class_defaults.json")
SIZE_FIELDS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "num_experts_per_tok",
        "num_local_experts",
        "num_experts",
        "n_routed_experts",
        "n_shared_experts",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "decoder_sparse_step",
        "first_k_dense_replace",
        "moe_layer_freq",
        "topk_method",
        "kv_lora_rank",
        "q_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "full_attention_interval",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
        "attn_layer_period",
        "attn_layer_offset",
        "expert_layer_period",
        "expert_layer_offset",
        "mamba_d_state",
        "mamba_d_conv",
        "mamba_expand",
        "mamba_dt_rank",
        "mamba_conv_bias",
        "n_positions",
        "n_embd",
        "n_layer",
        "n_head",
        "n_inner",
        "multi_query",
    }
)
_MISSING = object()


def _literal(node: ast.AST) -> Any:
    """A literal value, or arithmetic of numbers; `_MISSING` for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool, type(None))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _literal(node.operand)
        return -v if isinstance(v, (int, float)) and not isinstance(v, bool) else _MISSING
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Pow)):
        a, b = _literal(node.left), _literal(node.right)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (a, b)):
            return _MISSING
        if isinstance(node.op, ast.Pow) and not 0 <= b <= 64:
            return _MISSING
        ops = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__, ast.FloorDiv: int.__floordiv__}
        return a**b if isinstance(node.op, ast.Pow) else ops[type(node.op)](a, b)
    return _MISSING


def _model_type_of(cls: ast.ClassDef) -> str | None:
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "model_type" for t in stmt.targets):
            v = _literal(stmt.value)
            return v if isinstance(v, str) else None
    return None


def _defaults_of(cls: ast.ClassDef) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            out[stmt.target.id] = _literal(stmt.value)
        elif isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
            args = stmt.args
            positional = args.args[len(args.args) - len(args.defaults) :]
            for a, d in [*zip(positional, args.defaults), *zip(args.kwonlyargs, args.kw_defaults)]:
                if d is not None:
                    out.setdefault(a.arg, _literal(d))
    return {k: v for k, v in out.items() if k in SIZE_FIELDS and v is not _MISSING}


def parse_config_source(text: str, model_type: str) -> tuple[str, dict[str, Any]] | None:
    """(class name, size-field defaults) of the class in `text` whose model_type matches."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and _model_type_of(node) == model_type:
            return node.name, _defaults_of(node)
    return None


def _transformers_dir() -> Path | None:
    try:
        spec = importlib.util.find_spec("transformers")  # locates; does not import
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _transformers_version(root: Path) -> str:
    for dist in root.parent.glob("transformers-*.dist-info"):
        return dist.name[len("transformers-") : -len(".dist-info")]
    return "installed"


@lru_cache(maxsize=64)
def from_transformers(model_type: str) -> tuple[str, dict[str, Any]] | None:
    """(where, defaults) from the installed transformers' source, or None."""
    root = _transformers_dir()
    if root is None or not model_type or not model_type.replace("_", "").isalnum():
        return None
    models = root / "models"
    stems = [model_type, model_type.removesuffix("_text"), model_type.replace("-", "_")]
    files = [models / s / f"configuration_{s}.py" for s in dict.fromkeys(stems)]
    files += sorted(f for f in models.glob("*/configuration_*.py") if f not in files)  # any other family
    needle = f'model_type = "{model_type}"'
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except OSError:
            continue
        if needle not in text:
            continue
        found = parse_config_source(text, model_type)
        if found is not None:
            name, defaults = found
            return f"{name} (transformers {_transformers_version(root)})", defaults
    return None


@lru_cache(maxsize=1)
def _table() -> dict[str, Any]:
    return json.loads(TABLE.read_text())


def from_table(model_type: str) -> tuple[str, dict[str, Any]] | None:
    entry = _table()["classes"].get(model_type)
    if entry is None:
        return None
    return f"{entry['class']} (transformers {_table()['transformers']}, table)", dict(entry["defaults"])


def class_defaults(model_type: str) -> tuple[str, dict[str, Any]]:
    """(which class, its size-field defaults) for `model_type`; ("", {}) if none known."""
    return from_transformers(model_type) or from_table(model_type) or ("", {})
