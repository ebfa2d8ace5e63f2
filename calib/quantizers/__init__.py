"""Layer quantizers: one module per method, registered by its scheme's method name.

The pipeline (`calib/pipeline.py`) asks the registry for the quantizer of a scheme and
calls it on one decoder layer at a time; it knows no method by name.

Adding a method:
1. its solver, a pure function `(W (N, K), LayerStats, scheme) -> weight`, in `packers/`;
2. its scheme dataclass (defaults, `kind`, `check_shapes`, `for_storage`, `describe`) in
   `packers/scheme.py`, with one line in `SCHEMES`;
3. a module here, `calib/quantizers/<method>.py`, defining `QUANTIZER`, an instance of a
   `LayerQuantizer` subclass (`base.py`) that declares what it needs (`needs`: Hessian,
   activation statistics, live block outputs, an extra pass over the quantized layer,
   or nothing), whether it can run from saved statistics (`stats_refusal`), and
   implements `solve` (one linear) or overrides `quantize_layer` (a whole layer);
4. one line in `QUANTIZERS` below.
The CLI flags and recipe keys of the scheme's options are declared once, in
`calib/recipe.py`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from infer_tool.common.errors import BadInput

if TYPE_CHECKING:
    from infer_tool.calib.quantizers.base import LayerQuantizer

# scheme method name -> module defining QUANTIZER (imported when first used)
QUANTIZERS: dict[str, str] = {
    "rtn": "infer_tool.calib.quantizers.rtn",
    "gptq": "infer_tool.calib.quantizers.gptq",
    "awq": "infer_tool.calib.quantizers.awq",
    "fp8": "infer_tool.calib.quantizers.fp8",
}


def quantizer_for(scheme: Any) -> LayerQuantizer:
    """The layer quantizer registered for `scheme`'s method."""
    module = QUANTIZERS.get(scheme.method)
    if module is None:
        raise BadInput(f"no layer quantizer is registered for method {scheme.method!r}; registered: {', '.join(QUANTIZERS)}")
    return importlib.import_module(module).QUANTIZER
