"""Where the pipeline's decoder layers come from and where they go: `LayerIO`.

The layer loop (`calib/pipeline.py`) calls, for a model of L decoder layers:
- `start(X, L, result)` once, after capture: the first layer to run and its inputs (0 and
  the captured X; a resumed run answers where it stopped and the inputs it saved, and puts
  the finished layers' report entries back into `result`);
- `load(i, layer, device)` before layer i is measured and quantized;
- `done(i, layer, X_next, result)` once it has produced the next layer's inputs.

The default keeps the whole model in memory: `load` moves the layer to the device and
`done` moves it back. The quantize job's streamed run (`jobs/layer_stream.py`) reads the
layer's weights from the source files in `load`, and writes its checkpoint tensors, saves
the progress and frees it in `done`. This module knows nothing about files.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class LayerIO:
    """The whole model in memory (the default)."""

    def __init__(self) -> None:
        self._home: dict[int, torch.device] = {}

    def start(self, X: list[torch.Tensor], n_layers: int, result: Any) -> tuple[int, list[torch.Tensor]]:
        return 0, X

    def load(self, index: int, layer: nn.Module, device: torch.device) -> None:
        self._home[index] = next(layer.parameters()).device
        layer.to(device)

    def done(self, index: int, layer: nn.Module, X_next: list[torch.Tensor], result: Any) -> None:
        layer.to(self._home.pop(index))
