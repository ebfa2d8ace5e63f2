"""Quantization schemes: the `Scheme` contract (`base.py`), the methods' configs (`methods.py`:
GPTQ, AWQ, AutoRound, the observer), the declaration of a scheme field as a `quantize` option
(`options.py`), one module per family of number formats composing them (`integer.py`, `fp8.py`,
`fp4.py`), and the registry that builds them by method name (`registry.py`).

Standard library only (torch inside functions): the CLI reads the schemes' options and
defaults at start-up.
"""
