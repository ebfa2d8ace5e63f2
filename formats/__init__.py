"""Number formats, one package each: what a format is, declared once and found by the
registry (`registry.py`), never by `isinstance` or a name test elsewhere.

A format package's `__init__.py` holds its `NumberFormat` (`base.py`): its scheme classes,
its presets under llm-compressor's names, its on-disk codecs, the modules registering its
layer quantizers, its activations as deployed (`deployed.py`: how `quantize --eval` runs the
model in memory), and its kernel. Descriptors are standard library only: the CLI reads the
schemes and presets at start-up; what needs torch is named by module and imported when used.
"""
