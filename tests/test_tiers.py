"""The test tiers of tests/conftest.py: its tripwires fire on what the fast tier excludes, and its
lists name tests that exist.

The spawners below (and the wired functions) sit in tables, where the static rule (a test's source,
or a function it calls, naming a way to start a process) does not look: so these tests are in the
fast tier, armed, and it is the tripwire that must stop them (test_tiers_own_tests_are_fast).
"""

from __future__ import annotations

import ast
import functools
import multiprocessing
import subprocess
import sys
from pathlib import Path

import conftest
import pytest
import torch

TESTS = Path(__file__).resolve().parent
PROBE = "tests/test_tiers.py::probe"
SPAWNERS = {
    "subprocess.run(python)": lambda: subprocess.run([sys.executable, "-c", "pass"], check=False),
    "Popen(python3 by path)": lambda: subprocess.Popen([str(Path(sys.executable).with_name("python3")), "-V"]),
    "Popen(infer-tool, shell string)": lambda: subprocess.Popen("infer-tool --help", shell=False),
    "multiprocessing": lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
}
OTHER_PROGRAMS = {"true": lambda: subprocess.run(["true"], check=False)}  # not Python
WIRED = (subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start)


@pytest.mark.parametrize("how", sorted(SPAWNERS))
def test_starting_a_python_process_trips(how: str) -> None:
    with pytest.raises(conftest.TierViolation, match="is in the fast tier but started a"), conftest.armed(PROBE):
        SPAWNERS[how]()


def test_other_programs_and_unarmed_code_pass() -> None:
    with conftest.armed(PROBE):
        assert OTHER_PROGRAMS["true"]().returncode == 0
    saved = list(conftest._armed)  # this test's own id: it runs in the fast tier
    conftest._armed.clear()
    try:
        conftest.trip("nothing: no fast test is armed")  # outside a fast test the wire is slack
    finally:
        conftest._armed[:] = saved


def _llama_config(hidden: int, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def test_a_model_above_tiny_trips_through_the_auto_classes_and_from_pretrained(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    conftest.install_model_tripwires()
    big = _llama_config(hidden=256, layers=4)  # about 3.9 M parameters
    with torch.device("meta"), conftest.armed(PROBE):
        with pytest.raises(conftest.TierViolation, match=r"loaded a model of [0-9,]+ parameters"):
            AutoModelForCausalLM.from_config(big)
        small = AutoModelForCausalLM.from_config(_llama_config(hidden=64, layers=2))
    assert sum(p.numel() for p in small.parameters()) < conftest.TINY_PARAMS
    LlamaForCausalLM(big).save_pretrained(tmp_path)  # unarmed: building by the constructor is allowed
    with pytest.raises(conftest.TierViolation, match="LlamaForCausalLM.from_pretrained"), conftest.armed(PROBE):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_tripwires_are_installed() -> None:
    from transformers.modeling_utils import PreTrainedModel

    conftest.install_model_tripwires()
    assert all(fn.tier_tripwire for fn in WIRED)
    for name in ("from_pretrained", "_from_config"):
        assert PreTrainedModel.__dict__[name].__func__.tier_tripwire, name


@functools.cache
def _defined(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_the_lists_name_tests_that_exist() -> None:
    for module in conftest.SLOW_MODULES:
        assert (TESTS / module).is_file(), f"SLOW_MODULES names {module}, which is not in tests/"
    for entry in conftest.SLOW_TESTS:
        module, _, name = entry.partition("::")
        assert (TESTS / module).is_file() and name in _defined(TESTS / module), (
            f"SLOW_TESTS names {entry}, which is not a test"
        )


SAMPLE = """
import subprocess, sys

def run_python(code):
    return subprocess.run([sys.executable, "-c", code], check=False)

def check_startup():
    return run_python("pass")

def test_through_two_helpers():
    assert check_startup().returncode == 0

def test_in_its_body():
    assert subprocess.run(["true"]).returncode == 0

def test_pure():
    assert sorted([2, 1]) == [1, 2]
"""


def test_the_static_rule_sees_a_process_started_through_helpers(tmp_path: Path) -> None:
    import importlib.util

    path = tmp_path / "sample_tiers.py"
    path.write_text(SAMPLE)
    spec = importlib.util.spec_from_file_location("sample_tiers", path)
    sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample)
    assert conftest._starts_process(sample.test_through_two_helpers)
    assert conftest._starts_process(sample.test_in_its_body)
    assert not conftest._starts_process(sample.test_pure)
    assert not conftest._starts_process(test_tiers_own_tests_are_fast)


def test_tiers_own_tests_are_fast(request: pytest.FixtureRequest) -> None:
    """Every test of this module is in the fast tier, so the wires above were armed for real."""
    mine = [item for item in request.session.items if item.path == request.node.path]
    assert request.node in mine
    assert [item.name for item in mine if conftest.slow_reason(item) is not None] == []
    assert all(item.get_closest_marker("fast") is not None for item in mine)
