"""What the CLI prints fits a terminal: progress bars keep their count and elapsed time whole
at 80 columns (and narrower), with libraries' long bar descriptions shortened."""

from __future__ import annotations

import re

import pytest

from infer_tool.cli.output import TASK_WIDTH, progress_bar, task_name

ELAPSED = re.compile(r"\b\d+:\d\d:\d\d\b")  # rich's TimeElapsedColumn, e.g. 0:00:03


def _draw(width: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """Three bars as the main job draws them (transformers' GGUF conversion through its tqdm,
    the layer loop with its error, a perplexity with two figures), rendered `width` wide."""
    import tqdm.auto

    monkeypatch.setenv("COLUMNS", str(width))
    with progress_bar() as update:
        for _ in tqdm.auto.tqdm(range(272), desc="Converting and de-quantizing GGUF tensors..."):
            pass
        update("quantize", 30, 30, rel_err=0.05112)
        update("perplexity /tmp/run/smollm2-135m-awq-w4g64", 7, 20, tok_s=408.2, ppl=22.14)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 3, lines
    return lines


@pytest.mark.parametrize("width", [80, 60, 40, 120])
def test_bars_keep_count_and_elapsed_time(
    width: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gguf, quantize, ppl = _draw(width, monkeypatch, capsys)
    for line, count in ((gguf, "272/272"), (quantize, "30/30"), (ppl, " 7/20")):
        assert len(line) <= width, line
        assert count in line, line
        assert ELAPSED.search(line), line
    assert gguf.startswith("read GGUF "), gguf  # transformers' own description is 41 characters
    assert "Converting" not in gguf
    assert ppl.startswith("perplexity "), ppl
    assert "/tmp/run" not in ppl, ppl  # a path by its last part
    if width >= 80:
        assert "rel_err=0.05112" in quantize, quantize
        assert "tok_s=408.2  ppl=22.14" in ppl, ppl
        assert "\u2501" in quantize, quantize  # the bar itself
        assert "w4g64" in ppl, ppl
    if width >= 100:
        assert len(ELAPSED.findall(quantize)) == 2, quantize  # elapsed and the time left


def test_old_layout_lost_the_numbers_at_80_columns() -> None:
    """The reference this fix is checked against: rich's default columns, as the CLI built them
    before, cut the count and the times at 80 columns (issue 27's `make demo` log)."""
    import io

    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    buf = io.StringIO()
    bars = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(file=buf, width=80),
    )
    with bars:
        bars.add_task("Converting and de-quantizing GGUF tensors", total=272, completed=272, info="")
        bars.add_task("quantize", total=30, completed=30, info="rel_err=0.05112")
    gguf, _ = buf.getvalue().splitlines()
    assert "272/272" not in gguf and not ELAPSED.search(gguf), gguf


def test_task_names() -> None:
    assert task_name("Converting and de-quantizing GGUF tensors") == "read GGUF"
    assert task_name("Loading weights") == "load weights"
    assert task_name("ppl before") == "ppl before"
    assert task_name("perplexity /a/b/ckpt/") == "perplexity ckpt"
    long = task_name("x" * 50)
    assert len(long) == TASK_WIDTH and "\u2026" in long
