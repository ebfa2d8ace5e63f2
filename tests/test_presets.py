"""`--scheme PRESET` (`schemes/presets.py`): llm-compressor's preset names as combinations of
our options."""

from __future__ import annotations

import pytest

from infer_tool.common.errors import BadInput
from infer_tool.schemes.presets import PRESETS, get_preset


def test_names_are_unique_and_found_in_any_case() -> None:
    names = [p.name for p in PRESETS]
    assert len({n.upper() for n in names}) == len(names)
    assert get_preset("w8a8") is get_preset("W8A8")
    assert get_preset("fp8_dynamic").name == "FP8_DYNAMIC"


@pytest.mark.parametrize("name,close", [("W8A9", "W8A8"), ("FP8DYNAMIC", "FP8_DYNAMIC"), ("W4A16ASYM", "W4A16_ASYM")])
def test_an_unknown_name_gets_did_you_mean(name: str, close: str) -> None:
    with pytest.raises(BadInput, match=f"--scheme '{name}' is not a preset we support; did you mean {close}"):
        get_preset(name)


def test_an_unrelated_name_lists_every_preset() -> None:
    with pytest.raises(BadInput) as e:
        get_preset("banana")
    assert "did you mean" not in str(e.value)
    assert all(p.name in str(e.value) for p in PRESETS)


def _scheme(recipe: dict, flags: dict):
    from infer_tool.calib.recipe import merge, scheme_from_options

    return scheme_from_options(merge(recipe, flags))


@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_every_preset_is_the_flags_it_lists(preset) -> None:
    """A preset builds the scheme that its --list-schemes flags, parsed by the CLI, build."""
    import typer.main

    from infer_tool.calib.recipe import OPTIONS, preset_flags
    from infer_tool.cli.app import app

    scheme = _scheme({}, {"scheme": preset.name})
    for field, value in preset.options.items():
        assert getattr(scheme, field) == value
    assert scheme.method == (preset.method or "awq")
    command = typer.main.get_command(app).commands["quantize"]
    parsed = command.make_context("quantize", preset_flags(preset.name), resilient_parsing=True).params
    flags = {k: v for k, v in parsed.items() if k in OPTIONS and v not in (None, ())}
    assert "scheme" not in flags and _scheme({}, flags) == scheme


def test_explicit_options_override_the_preset_and_recipes_take_scheme(tmp_path) -> None:
    from infer_tool.calib.recipe import load_recipe

    s = _scheme({}, {"scheme": "W8A8", "int8_activations": "static", "method": "rtn"})
    assert (s.method, s.int8_activations, s.bits, s.group_size) == ("rtn", "static", 8, -1)
    (tmp_path / "r.yaml").write_text("scheme: W4A16_ASYM\nmethod: gptq\ngroup_size: 64\n")
    s = _scheme(load_recipe(tmp_path / "r.yaml"), {})
    assert (s.method, s.bits, s.group_size, s.symmetric) == ("gptq", 4, 64, False)
    s = _scheme(load_recipe(tmp_path / "r.yaml"), {"scheme": "W8A16"})  # the flag's preset wins over the recipe's
    assert (s.bits, s.group_size, s.symmetric) == (8, 64, True)
    with pytest.raises(
        BadInput, match="--scheme FP8_DYNAMIC sets --fp8-granularity, --fp8-activations, which --method"
    ):
        _scheme({}, {"scheme": "FP8_DYNAMIC", "method": "awq"})


def test_list_schemes_prints_every_preset() -> None:
    import json

    from typer.testing import CliRunner

    from infer_tool.cli.app import app

    r = CliRunner().invoke(app, ["quantize", "--list-schemes", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["schemes"]
    assert [row["scheme"] for row in rows] == [p.name for p in PRESETS]
    w8a8 = next(row for row in rows if row["scheme"] == "W8A8")
    assert w8a8["flags"] == [
        "--method",
        "gptq",
        "--bits",
        "8",
        "--group-size",
        "-1",
        "--sym",
        "--int8-activations",
        "dynamic",
    ]
    r = CliRunner().invoke(app, ["quantize", "--list-schemes"])
    assert r.exit_code == 0 and "FP8_DYNAMIC" in r.stdout and "--fp8-granularity channel" in r.stdout


def test_preset_checkpoint_equals_the_explicit_flags_and_old_stats_refuse_smoothquant(tmp_path) -> None:
    """`--scheme W8A8` writes the bytes of `--method gptq --bits 8 --group-size -1 --sym
    --int8-activations dynamic`; --smoothquant with statistics saved before version 2 exits 2."""
    import json

    from tiny import TEXT, save_tiny_llama
    from typer.testing import CliRunner

    from infer_tool.cli.app import app

    model = save_tiny_llama(tmp_path / "model", tie=False)
    (tmp_path / "calib.txt").write_text(TEXT * 4)
    common = [
        "quantize",
        str(model),
        "--calib",
        str(tmp_path / "calib.txt"),
        "--num-samples",
        "2",
        "--seq-len",
        "32",
        "--no-progress",
        "--device",
        "cpu",
    ]
    runner = CliRunner()
    for name, args in (
        ("preset", ["--scheme", "W8A8"]),
        ("flags", ["--method", "gptq", "--bits", "8", "--group-size", "-1", "--sym", "--int8-activations", "dynamic"]),
    ):
        r = runner.invoke(app, [*common, *args, "--out", str(tmp_path / name)])
        assert r.exit_code == 0, r.output[-2000:]
    assert (tmp_path / "preset" / "model.safetensors").read_bytes() == (
        tmp_path / "flags" / "model.safetensors"
    ).read_bytes()

    stats = tmp_path / "stats"
    r = runner.invoke(
        app,
        [
            "calibrate",
            str(model),
            "--out",
            str(stats),
            "--calib",
            str(tmp_path / "calib.txt"),
            "--num-samples",
            "2",
            "--seq-len",
            "32",
            "--no-progress",
        ],
    )
    assert r.exit_code == 0, r.output[-2000:]
    ok = runner.invoke(
        app,
        [
            *common[:2],
            "--stats",
            str(stats),
            "--scheme",
            "W8A8",
            "--smoothquant",
            "0.5",
            "--out",
            str(tmp_path / "sq"),
            "--no-progress",
        ],
    )
    assert ok.exit_code == 0, ok.output[-2000:]
    index = json.loads((stats / "stats_index.json").read_text())
    (stats / "stats_index.json").write_text(json.dumps({**index, "version": 1}))
    r = runner.invoke(
        app,
        [
            *common[:2],
            "--stats",
            str(stats),
            "--scheme",
            "W8A8",
            "--smoothquant",
            "0.5",
            "--out",
            str(tmp_path / "old"),
            "--no-progress",
        ],
    )
    assert r.exit_code == 2 and "holds no per-channel activation maxima" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "old").exists()
