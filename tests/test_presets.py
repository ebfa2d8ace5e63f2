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
