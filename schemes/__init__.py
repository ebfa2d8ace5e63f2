"""Quantization schemes: the `Scheme` contract (`base.py`), one module per family of number
formats (`integer.py`: RTN, GPTQ, AWQ; `fp8.py`), and the registry that builds them by
method name (`registry.py`, whose docstring is the recipe for adding a format or a method).

Standard library only (torch inside functions): the CLI reads the schemes' options and
defaults at start-up.
"""
