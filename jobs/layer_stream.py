"""The quantize job's `LayerIO` (`calib/layer_io.py`): what happens around each decoder layer.

Before layer i is calibrated (`load`): its tensors are read from the source safetensors
onto the device (a streamed model; an in-memory one is moved there), and with --eval the
evaluation windows go through it as it is (fp). After it is quantized (`done`): the
windows go through it as quantized (as deployed, for FP8), its checkpoint tensors are
written to the run directory, the next layer's inputs and the report entries so far are
saved (`jobs/run_dir.py`), its quantized weights are kept as shapes only (meta), its
statistics dropped, and its memory freed. So the host holds one layer, the activations,
and at the start and end the tensors outside the layers (embeddings, norm, lm_head).

`ppl_of_streams` scores the evaluation windows' last hidden states with the model's own
head (`evaluate_ppl` on the model whose layers replay them): the same windows and numbers
as evaluating the whole model, without it. `kld_of_streams` does the same for two streams
at once (the fp and the quantized model's): their KL divergence window by window
(`evals/kld.kld_of_windows`) and both perplexities.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from infer_tool.calib.layer_io import LayerIO
from infer_tool.calib.layers import LayerCall, run_layer
from infer_tool.jobs.run_dir import REST, RunDir, restore, snapshot


@dataclass
class EvalStreams:
    """The --eval windows on their way through the layers: hidden states (1, T, D) per window."""

    calls: list[list[LayerCall]]  # [layer][window]
    fp: list[torch.Tensor] | None  # through the fp layers so far; None: the fp baseline is known (cached)
    q: list[torch.Tensor]  # through the quantized layers so far


class StreamedWeights:
    """A skeleton model's tensors read from the source files (`calib/streaming.py`)."""

    def __init__(self, model: nn.Module, files: Any, plan: dict[str, str], round_dtype: torch.dtype | None) -> None:
        self.model, self.files, self.plan, self.round_dtype = model, files, plan, round_dtype

    def names(self, prefix: str | None, layers: str) -> list[str]:
        """Slot names in module `prefix`, or (None) outside the decoder layers."""
        if prefix is None:
            return [n for n in self.plan if not n.startswith(f"{layers}.")]
        return [n for n in self.plan if n.startswith(f"{prefix}.")]

    def load(self, names: list[str], device: torch.device) -> None:
        from infer_tool.calib.streaming import materialize

        materialize(self.model, names, self.plan, self.files, device, self.round_dtype)

    def release(self, names: list[str]) -> None:
        from infer_tool.calib.streaming import release

        release(self.model, names)


class LayerStream(LayerIO):
    """The `LayerIO` of a quantize run (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        layers_path: str,
        run: RunDir,
        *,
        part_tensors: Callable[[str | None, dict[str, Any]], dict],
        read_part: Callable[[dict[str, torch.Tensor]], dict[str, Any]],
        weights: StreamedWeights | None,
        evals: EvalStreams | None,
        deployed: Callable[[nn.Module, str, Any], AbstractContextManager],
        trim_above: int | None = None,
    ) -> None:
        """part_tensors(prefix or None, {linear: weight}) -> a part's checkpoint tensors;
        read_part(tensors) -> {linear: weight} (the format's reader); deployed(layer, prefix,
        result) -> the context in which the quantized layer runs as deployed; trim_above: the
        resident bytes above which a streamed layer's freed memory goes back to the OS
        (`streaming.trim_heap`; None: after every layer)."""
        super().__init__()
        self.trim_above = trim_above
        self.model, self.layers_path, self.run, self.part_tensors = model, layers_path, run, part_tensors
        self.read_part, self.weights, self.evals, self.deployed = read_part, weights, evals, deployed
        self.seconds_spent: dict[str, float] = {}  # load, write, eval_layers
        self._rest_loaded = weights is not None

    def _time(self, key: str, t0: float) -> None:
        self.seconds_spent[key] = self.seconds_spent.get(key, 0.0) + time.perf_counter() - t0

    def write_rest(self) -> None:
        """The checkpoint tensors outside the layers, once (a resumed run has them)."""
        if not self.run.state["rest"]:
            t0 = time.perf_counter()
            self.run.write_tensors(REST, self.part_tensors(None, {}))
            self.run.rest_written()
            self._time("write", t0)

    def release_rest(self) -> None:
        """Free the tensors outside the layers (streamed), once the capture is over."""
        if self._rest_loaded:
            self.weights.release(self.weights.names(None, self.layers_path))
            self._rest_loaded = False

    def start(self, X: list[torch.Tensor], n_layers: int, result: Any) -> tuple[int, list[torch.Tensor]]:
        self.release_rest()
        k = self.run.layers_done
        if k == 0:
            return 0, X
        from infer_tool.packers.safetensors_stream import read_all

        restore(result, self.run.state["result"])
        for i in range(k):  # the finished layers' weights, as shapes (meta), as `done` leaves them
            for name, w in self.read_part(read_all(self.run.layer_file(i))).items():
                result.quantized[name] = w.to("meta")
        saved = self.run.load_inputs()
        dev = X[0].device if X else torch.device("cpu")
        X = [saved[f"x.{c}"].to(dev) for c in range(sum(n.startswith("x.") for n in saved))]
        if self.evals is not None:
            W = len(self.evals.q)
            if self.evals.fp is not None:
                self.evals.fp = [saved[f"eval_fp.{w}"].to(self.evals.fp[w].device) for w in range(W)]
            self.evals.q = [saved[f"eval_q.{w}"].to(self.evals.q[w].device) for w in range(W)]
        return k, X

    def load(self, index: int, layer: nn.Module, device: torch.device) -> None:
        t0 = time.perf_counter()
        if self.weights is None:
            super().load(index, layer, device)
        else:
            from infer_tool.calib.streaming import put_buffers

            self.weights.load(self.weights.names(f"{self.layers_path}.{index}", self.layers_path), device)
            put_buffers(layer, device)
        self._time("load", t0)
        if self.evals is not None and self.evals.fp is not None:
            t0 = time.perf_counter()
            self.evals.fp = run_layer(layer, self.evals.fp, self.evals.calls[index])
            self._time("eval_layers", t0)

    def done(self, index: int, layer: nn.Module, X_next: list[torch.Tensor], result: Any) -> None:
        prefix = f"{self.layers_path}.{index}"
        mine = {n: w for n, w in result.quantized.items() if n.startswith(f"{prefix}.")}
        if self.evals is not None:
            t0 = time.perf_counter()
            with self.deployed(layer, prefix, result):
                self.evals.q = run_layer(layer, self.evals.q, self.evals.calls[index])
            self._time("eval_layers", t0)
        t0 = time.perf_counter()
        self.run.write_tensors(self.run.layer_file(index).name, self.part_tensors(prefix, mine))
        for n, w in mine.items():
            result.quantized[n] = w.to("meta")
        for n in [n for n in result.stats if n.startswith(f"{prefix}.")]:
            del result.stats[n]
        inputs = {f"x.{c}": x for c, x in enumerate(X_next)}
        if self.evals is not None:
            inputs.update({f"eval_fp.{w}": x for w, x in enumerate(self.evals.fp or [])})
            inputs.update({f"eval_q.{w}": x for w, x in enumerate(self.evals.q)})
        self.run.layer_finished(index, {k: v.to("cpu") for k, v in inputs.items()}, snapshot(result))
        self._time("write", t0)
        if self.weights is None:
            super().done(index, layer, X_next, result)
        else:
            from infer_tool.calib.streaming import trim_heap

            self.weights.release(self.weights.names(prefix, self.layers_path))
            trim_heap(self.trim_above)


class _Replay(nn.Module):
    """Stands in for the last decoder layer: returns the saved hidden states `outputs[next]`,
    window after window (`next` may be set to pick one)."""

    def __init__(self, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.outputs, self.next = outputs, 0

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.outputs[self.next]
        self.next += 1
        return out


class _Skip(nn.Module):
    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


@torch.no_grad()
def ppl_of_streams(
    model: nn.Module,
    layers: nn.ModuleList,
    ids: torch.Tensor,
    seq_len: int,
    outputs: list[torch.Tensor],
    device: torch.device,
    *,
    progress: Any,
) -> Any:
    """`evaluate_ppl` of `ids` (T,) in `seq_len` windows, where the decoder layers' output for
    window w is `outputs[w]`: the layers are replaced (the rest of the model, embeddings,
    norm and head, runs on `device`, then goes back to the CPU)."""
    from infer_tool.evals.ppl import evaluate_ppl

    originals = list(layers)
    try:
        for i in range(len(layers)):
            layers[i] = _Replay(outputs) if i == len(layers) - 1 else _Skip()
        model.to(device)
        return evaluate_ppl(model, ids.to(device), seq_len, progress=progress)
    finally:
        model.to("cpu")
        for i, layer in enumerate(originals):
            layers[i] = layer


@torch.no_grad()
def kld_of_streams(
    model: nn.Module,
    layers: nn.ModuleList,
    ids: torch.Tensor,
    seq_len: int,
    *,
    ref_outputs: list[torch.Tensor],
    outputs: list[torch.Tensor],
    device: torch.device,
    progress: Any,
) -> tuple[Any, Any, Any]:
    """(`KldResult` of KL(reference ‖ model), the reference's `PplResult`, the model's) on `ids`
    (T,) in `seq_len` windows, where the decoder layers' output for window w is
    `ref_outputs[w]` for the reference and `outputs[w]` for the model; each window's logits of
    both come from the model's own head (which quantizing leaves as it is), so each
    `PplResult` equals `ppl_of_streams` of its stream."""
    import time

    from infer_tool.evals.kld import WindowPair, kld_of_windows
    from infer_tool.evals.ppl import check_vocab, make_windows, nll_sum, ppl_of_nll, window_logits

    windows = make_windows(ids.numel(), seq_len)
    ref_nll, nll = [0.0] * len(windows), [0.0] * len(windows)
    originals = list(layers)
    replay = _Replay(outputs)
    try:
        for i in range(len(layers)):
            layers[i] = replay if i == len(layers) - 1 else _Skip()
        model.to(device)
        check_vocab(model, ids)
        on_device = ids.to(device)

        def pair(i: int) -> WindowPair:
            replay.outputs, replay.next = ref_outputs, i
            ref_logits, target = window_logits(model, on_device, windows[i], "the fp model")
            replay.outputs, replay.next = outputs, i
            logits, _ = window_logits(model, on_device, windows[i], "the quantized model")
            ref_nll[i], nll[i] = nll_sum(ref_logits, target), nll_sum(logits, target)
            return WindowPair(ref_logits, logits, target)

        t0 = time.perf_counter()
        result = kld_of_windows(windows, pair, seq_len=seq_len, progress=progress)
        seconds = time.perf_counter() - t0
    finally:
        model.to("cpu")
        for i, layer in enumerate(originals):
            layers[i] = layer
    return (
        result,
        ppl_of_nll(ref_nll, windows, seq_len, None, seconds),
        ppl_of_nll(nll, windows, seq_len, None, seconds),
    )
