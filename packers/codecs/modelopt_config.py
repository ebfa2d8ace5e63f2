"""A legacy ModelOpt export's `hf_quant_config.json` (its config outside config.json), read as a
`quantization_config`. Standard library only: `calib/models.py` and `packers/checkpoint.py` ask it
whether a directory is quantized without importing the NVFP4 reader (`packers/codecs/modelopt_nvfp4.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from infer_tool.common.errors import BadInput

HF_QUANT_CONFIG = "hf_quant_config.json"


def hf_quant_config(directory: str | Path) -> dict[str, Any] | None:
    """A legacy ModelOpt export's `hf_quant_config.json` as a `quantization_config` (quant_method
    "modelopt" added), or None when the directory has none."""
    path = Path(directory) / HF_QUANT_CONFIG
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except ValueError:
        raise BadInput(f"{path} is not JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("quantization"), dict):
        raise BadInput(f"{path} has no 'quantization' object (ModelOpt's layout)")
    return {"quant_method": "modelopt", **doc}
