"""Write sizing/class_defaults.json: the size-field defaults of the transformers config
class of every family kv-budget sizes, read from the classes themselves (this imports
transformers, and with it torch; kv-budget never does: it reads this table, or the
installed transformers' source with `ast`, `sizing/class_defaults.py`).

    python benchmarks/kv_class_defaults.py
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import transformers
from transformers import AutoConfig

from infer_tool.sizing.class_defaults import SIZE_FIELDS, TABLE
from infer_tool.sizing.config_view import KNOWN_MODEL_TYPES

EXTRA = {"qwen3_5_text", "gemma3_text", "qwen3_5_moe_text"}


def declared_defaults(cls: type) -> dict:
    """The defaults the class declares (dataclass fields in transformers 5, `__init__`
    keyword defaults in 4.x), before any `__post_init__` rewrites them."""
    out = {}
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if p.default is not inspect.Parameter.empty:
            out.setdefault(name, p.default)
    return {k: v for k, v in out.items() if k in SIZE_FIELDS and isinstance(v, (int, float, str, bool, type(None)))}


def config_class(model_type: str) -> type | None:
    try:
        return type(AutoConfig.for_model(model_type))
    except (ValueError, KeyError):
        return None


def main() -> None:
    classes = {}
    for mt in sorted(KNOWN_MODEL_TYPES | EXTRA):
        cls = config_class(mt)
        if cls is not None and cls.model_type == mt:
            classes[mt] = {"class": cls.__name__, "defaults": declared_defaults(cls)}
    doc = {
        "_about": "Size-field defaults of transformers' config classes, per model_type, written by "
        "benchmarks/kv_class_defaults.py from the classes (tests/test_kv_class_defaults.py checks them)",
        "transformers": transformers.__version__,
        "classes": classes,
    }
    Path(TABLE).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"{len(classes)} classes -> {TABLE}")


if __name__ == "__main__":
    main()
