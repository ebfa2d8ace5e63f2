"""What the CLI prints fits a terminal: progress bars keep their count and elapsed time whole
at 80 columns (and narrower), with libraries' long bar descriptions shortened; every command's
and subcommand's `--help` keeps every flag whole, within the width, with a help column wide
enough to read, and the groups list their commands as single reflowed sentences."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys

import pytest
import typer
from typer import rich_utils
from typer.core import TyperCommand, TyperGroup, TyperOption
from typer.testing import CliRunner

from infer_tool.calib.recipe import OPTIONS
from infer_tool.cli.app import app
from infer_tool.cli.help_panels import PANELS, SWITCHES, PanelledCommand, install
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


# --- --help -------------------------------------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;]*m")
CUT_FLAG = re.compile(r"--[\w-]*\u2026")  # rich ends what it cut with an ellipsis
# Characters of help text per line. typer's one panel of every quantize option left ~20 (two or
# three words a line); its table spends 10 columns on padding, so a two-way flag as long as
# --fp8-clip-search/--no-fp8-clip-search leaves 29 even in a panel of its own (kv-budget's
# --async-scheduling/--no-async-scheduling 27).
MIN_HELP_COLUMN = 25
ROW_INDENT = 6  # an option row starts within the first columns (pad, the required star); help text further right


def _commands(command: TyperGroup | TyperCommand, path: tuple[str, ...] = ()):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


COMMANDS = dict(_commands(typer.main.get_command(app)))


def _render(path: tuple[str, ...], width: int, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(rich_utils, "MAX_WIDTH", None)  # TERMINAL_WIDTH in the environment would win
    r = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(width)}, terminal_width=width)
    assert r.exit_code == 0, r.output
    return ANSI.sub("", r.output)


def _panels(text: str) -> dict[str, list[str]]:
    """Panel title -> its lines inside the border."""
    panels: dict[str, list[str]] = {}
    title = None
    for line in text.splitlines():
        if line.startswith("\u256d\u2500"):
            title = re.match(r"\u256d\u2500 (.*?) \u2500", line).group(1)
            panels[title] = []
        elif line.startswith("\u2570"):
            title = None
        elif title is not None:
            panels[title].append(line[1:-1])
    return panels


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _help_column(lines: list[str]) -> int | None:
    """Width of an options panel's help column: from where wrapped help lines start to the
    border (less the cell's padding); None when every help text fits on its first line."""
    wrapped = [_indent(line) for line in lines if line.strip() and _indent(line) > ROW_INDENT]
    return len(lines[0]) - min(wrapped) - 1 if wrapped else None


def _row_flags(lines: list[str]) -> list[str]:
    """The first flag of each option row of a panel."""
    return [
        m.group(1)
        for line in lines
        if _indent(line) <= ROW_INDENT
        if (m := re.match(r"\s*(?:\*\s+)?(--?[\w-]+)", line))
    ]


def _flags(command) -> list[str]:
    return [
        o for p in command.params if isinstance(p, TyperOption) and not p.hidden for o in (*p.opts, *p.secondary_opts)
    ]


@pytest.mark.parametrize("width", [80, 120])
@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda p: " ".join(p) or "root")
def test_help_fits_and_keeps_every_flag_whole(
    path: tuple[str, ...], width: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = _render(path, width, monkeypatch)
    command = COMMANDS[path]
    assert max(len(line) for line in text.splitlines()) <= width
    assert not CUT_FLAG.search(text), CUT_FLAG.findall(text)
    if not any("\u2026" in (p.help or "") for p in command.params):
        assert "\u2026" not in text, [line for line in text.splitlines() if "\u2026" in line]
    for flag in [*_flags(command), "--help"]:  # --no-… forms included
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), f"{flag} not whole in {path} --help"
    for title, lines in _panels(text).items():
        if title == "Commands":
            continue
        column = _help_column(lines)
        assert column is None or column >= MIN_HELP_COLUMN, f"{' '.join(path)} {title!r}: help column {column}"


def _listing(lines: list[str]) -> tuple[dict[str, list[str]], int]:
    """A Commands panel: command name -> its description's lines, and the description column's width."""
    rows: dict[str, list[str]] = {}
    start = 0
    for line in lines:
        if _indent(line) == 1:  # a command's first line: its name, then the description
            name, rest = line.split(maxsplit=1)
            start = line.index(rest, 1 + len(name))
            rows[name] = []
        rows[list(rows)[-1]].append(line[start:].rstrip())
    return rows, len(lines[0]) - start - 1  # less the panel's padding


def _check_listing(text: str, group: TyperGroup) -> None:
    rows, width = _listing(_panels(text)["Commands"])
    assert sorted(rows) == sorted(n for n, c in group.commands.items() if not c.hidden)
    for name, lines in rows.items():
        sub = group.commands[name]
        first_paragraph = (sub.short_help or sub.help).split("\n\n")[0]
        assert " ".join(" ".join(lines).split()) == " ".join(first_paragraph.split()), name
        for line, following in itertools.pairwise(lines):  # filled: a line ends only where the next word does not fit
            assert len(line) + 1 + len(following.split()[0]) > width, f"{name}: line broken early: {line!r}"


@pytest.mark.parametrize(
    "path", [p for p, c in COMMANDS.items() if isinstance(c, TyperGroup)], ids=lambda p: " ".join(p) or "root"
)
def test_groups_list_their_commands_in_filled_lines(path: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    _check_listing(_render(path, 80, monkeypatch), COMMANDS[path])


def test_panels_follow_the_table() -> None:
    """Every command and flag the table names exists, once; quantize, calibrate, eval ppl/kld and
    spec-profile show each listed option in its panel, in the table's order of panels."""
    for key, panels in PANELS.items():
        command = COMMANDS.get(tuple(key.split()))
        assert command is not None, f"help_panels.PANELS names no command {key!r}"
        listed = [f for flags in panels.values() for f in flags]
        assert len(listed) == len(set(listed)), key
        assert set(listed) <= {*_flags(command), "--help"}, set(listed) - {*_flags(command), "--help"}


@pytest.mark.parametrize("key", list(PANELS))
def test_help_shows_the_table(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    panels = _panels(_render(tuple(key.split()), 80, monkeypatch))
    shown = [t for t in panels if t in PANELS[key]]
    assert shown == list(PANELS[key])
    for title, flags in PANELS[key].items():
        # the listed flags, then the options declared with this panel (the scheme options), as declared
        declared = [_first_flag(name) for name, f in OPTIONS.items() if f.metadata["panel"] == title]
        assert _row_flags(panels[title]) == list(flags) + (declared if key == "quantize" else []), title


def _first_flag(name: str) -> str:
    return (OPTIONS[name].metadata["flag"] or f"--{name.replace('_', '-')}").split("/")[0]


def test_unlisted_options_need_no_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """An option the table does not list (a new one) still renders: a two-way flag in a panel
    of its own, the rest in typer's default panel, the listed ones where the table says."""
    demo = typer.Typer()

    @demo.command("calibrate")
    def calibrate(
        calib: str = "x",
        new_option: int = 1,
        smoothquant: bool = typer.Option(True, "--smoothquant/--no-smoothquant"),
    ) -> None:
        pass

    @demo.command("other")
    def other() -> None:
        pass

    install(demo)
    monkeypatch.setattr(rich_utils, "MAX_WIDTH", None)
    r = CliRunner().invoke(demo, ["calibrate", "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    panels = _panels(ANSI.sub("", r.output))
    assert list(panels) == ["Options", "Calibration", "Run", SWITCHES]
    assert _row_flags(panels["Options"]) == ["--new-option"]
    assert _row_flags(panels["Calibration"]) == ["--calib"]
    assert _row_flags(panels["Run"]) == ["--help"]
    assert _row_flags(panels[SWITCHES]) == ["--smoothquant"]
    assert "--no-smoothquant" in panels[SWITCHES][0]


def test_one_panel_layout_was_unreadable_at_80_columns(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reference the panels are checked against: typer's default, every quantize option in
    one panel, leaves its help a column of about 20 characters; and a docstring's line breaks
    broke the root listing mid-line."""
    monkeypatch.setattr(rich_utils, "MAX_WIDTH", None)
    monkeypatch.setenv("COLUMNS", "80")
    fresh = typer.main.get_command(app)
    plain = TyperCommand("quantize", params=fresh.commands["quantize"].params, help="Quantize.")
    plain.format_help(typer.Context(plain), None)
    column = _help_column(_panels(ANSI.sub("", capsys.readouterr().out))["Options"])
    assert column < MIN_HELP_COLUMN, column  # 20 with typer 0.28

    fresh.commands["quantize"].short_help = None  # the docstring as typer lists it
    fresh.format_help(typer.Context(fresh, info_name="infer-tool"), None)
    with pytest.raises(AssertionError, match="quantize: line broken early"):
        _check_listing(ANSI.sub("", capsys.readouterr().out), fresh)


def test_console_script_help_is_what_the_tests_render(monkeypatch: pytest.MonkeyPatch) -> None:
    """`infer-tool quantize --help` through the entry point users run, at COLUMNS=80."""
    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb"}
    env.pop("TERMINAL_WIDTH", None)
    r = subprocess.run(
        [sys.executable, "-P", "-c", "from infer_tool.cli.app import main; main()", "quantize", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert ANSI.sub("", r.stdout) == _render(("quantize",), 80, monkeypatch)
    assert issubclass(type(COMMANDS[("quantize",)]), PanelledCommand)
