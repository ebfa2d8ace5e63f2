"""Which panel of `--help` each option is shown in, for every command: one table, applied
when `--help` is rendered, so that option declarations (calib/recipe.py, cli/options.py,
cli/commands/) carry no layout.

typer's rich help draws each panel as one table whose columns (flag, negative flag, type,
help) are as wide as the widest entry of the panel; a two-way flag such as
`--fp8-clip-search/--no-fp8-clip-search` in a panel of twenty options leaves the help text
of all twenty a column of ~20 characters at 80 columns. Topic panels, with the two-way
flags in a panel of their own, keep it at 40 or more.

An option the table does not list keeps the panel its declaration names (kv-budget's, the
scheme options'), placed by the title's row when the table has one, or
goes to "Switches" when it is a two-way flag, else to typer's default "Options": a new
option needs no edit here to render whole (tests/test_terminal_fit.py checks every
command at 80 columns). Panels are shown in the table's order; nothing outside help
rendering changes (parsing sees the parameters in their declared order).
"""

from __future__ import annotations

from typing import Any, ClassVar

import typer
from typer.core import TyperCommand

SWITCHES = "Switches"  # unlisted two-way flags

# command path -> panel title -> options, by their first flag as typed
PANELS: dict[str, dict[str, tuple[str, ...]]] = {
    "quantize": {
        # the scheme options join the panel their declaration names (schemes/options.option)
        "Method": ("--scheme", "--list-schemes", "--method", "--ignore"),
        "Method switches": (),
        "AutoRound": (),
        "INT8": (),
        "FP8": (),
        "FP4": (),
        "MXFP8": (),
        "MoE": ("--moe-calibration", "--moe-min-tokens"),
        "Mixed precision": ("--target-bits", "--candidates"),
        "Model-free": ("--model-free", "--default-ignore"),
        "Calibration": ("--calib", "--num-samples", "--seq-len", "--seed", "--stats"),
        "Calibration switches": ("--layer-error",),
        "Evaluation and gate": (
            "--eval",
            "--eval-activations",
            "--eval-tokens",
            "--eval-seq-len",
            "--max-ppl-increase",
            "--max-kld",
        ),
        "Evaluation switches": ("--kld",),
        "Output": ("--out", "--format", "--dtype", "--max-shard-size", "--overwrite", "--json"),
        "Run": (
            "--recipe",
            "--device",
            "--max-memory",
            "--resume",
            "--allow-pickle",
            "--trust-remote-code",
            "--no-progress",
            "--help",
        ),
        "Run switches": ("--stream",),
    },
    "calibrate": {
        "Calibration": ("--calib", "--num-samples", "--seq-len", "--seed"),
        "Output": ("--out", "--overwrite", "--json"),
        "Run": ("--device", "--allow-pickle", "--trust-remote-code", "--no-progress", "--help"),
    },
    "eval ppl": {
        "Corpus": ("--data", "--text-field", "--seq-len", "--max-tokens", "--stride"),
        "Model": ("--baseline", "--dtype", "--device", "--kv-cache-dtype", "--allow-pickle", "--trust-remote-code"),
        "Quantized activations": ("--activations", "--int8-kernel"),
        "Output": ("--json", "--no-progress", "--help"),
    },
    "eval kld": {
        "Corpus": ("--data", "--text-field", "--seq-len", "--max-tokens", "--stride"),
        "Models": ("--reference", "--dtype", "--device", "--kv-cache-dtype", "--allow-pickle", "--trust-remote-code"),
        "Output": ("--json", "--no-progress", "--help"),
    },
    "spec-profile": {
        "Models": ("--target", "--draft", "--dtype", "--device", "--threads", "--allow-pickle", "--trust-remote-code"),
        "Prompts": ("--prompts", "--text-field", "--num-prompts", "--prompt-len", "--max-new-tokens"),
        "Speculation": ("--k", "--temperature", "--top-p", "--seed", "--cost-ratio", "--no-loop", "--clock"),
        "vLLM engine": ("--engine", "--batch-sizes", "--repeats", "--vllm-python", "--vllm-timeout"),
        "GPU projection": ("--gpu", "--concurrency", "--hbm-efficiency", "--mfu"),
        "Output": ("--json", "--no-progress", "--help"),
    },
}


class PanelledCommand(TyperCommand):
    """A typer command whose `--help` groups its options by `panels` (title -> flags)."""

    panels: ClassVar[dict[str, tuple[str, ...]]] = {}
    _rendering_help = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.short_help is None and self.help:
            # typer's rich listing of a group keeps a docstring's line breaks; the first paragraph as one line
            self.short_help = " ".join(self.help.split("\n\n")[0].split())

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self._rendering_help = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._rendering_help = False

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        if not self._rendering_help:
            return params
        rank = {p.name: self._place(p) for p in params}
        return sorted(params, key=lambda p: rank[p.name])

    def _place(self, param: Any) -> tuple[int, int]:
        """Set `param`'s panel; its rank in the help: typer's default panel first, then the
        table's panels and options in the table's order, then the panels it does not list."""
        for i, (title, flags) in enumerate(self.panels.items()):
            found = [o for o in param.opts if o in flags]
            if found:
                param.rich_help_panel = title
                return i, flags.index(found[0])
            if getattr(param, "rich_help_panel", None) == title:  # declared with the option: after the listed
                return i, len(flags)
        if getattr(param, "rich_help_panel", None) is None and getattr(param, "secondary_opts", None):
            param.rich_help_panel = SWITCHES
        return (-1 if getattr(param, "rich_help_panel", None) is None else len(self.panels)), 0


def install(app: typer.Typer, path: tuple[str, ...] = ()) -> None:
    """Give every command of `app` (and of its sub-apps) its panels from PANELS; call after
    the commands are registered, before typer builds the click command."""
    for info in app.registered_commands:
        name = info.name or typer.main.get_command_name(info.callback.__name__)
        key = " ".join((*path, name))
        bases = (PanelledCommand,) if info.cls in (None, TyperCommand) else (PanelledCommand, info.cls)
        info.cls = type(f"{name.title().replace('-', '')}Command", bases, {"panels": PANELS.get(key, {})})
    for group in app.registered_groups:
        install(group.typer_instance, (*path, group.name))
