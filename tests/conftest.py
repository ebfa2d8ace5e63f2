"""Test tiers: the fast tier (`pytest -m fast`, `make test-fast`) and the whole suite (`make
test`, what CI runs). Which tests are fast is decided here, by what a test uses, not by markers
written into test files.

A collected test is in the fast tier (this file gives it the marker `fast`) unless:
- it carries a marker of SLOW_MARKERS (`slow`: the demo model or real text; `vllm`: vLLM's CPU
  build);
- its module is in SLOW_MODULES, or `module::function` is in SLOW_TESTS (every parametrization);
- it starts a process: its own source, a fixture it uses that is defined under tests/, or a
  function of tests/ that either calls (two calls deep) names `subprocess`, `sys.executable`,
  `multiprocessing`, `Popen` or `torchrun` (PROCESS_WORDS).

So a new test is fast unless it says otherwise by one of these. The fast tier holds numerics,
solvers against their references, codecs, schemes, sizing, the speculative-decoding math, CLI
refusals and tiny random models that take well under a second (the byte-exact guard's tiny
runs among them); SLOW_MODULES and SLOW_TESTS hold the Triton interpreter's kernel runs and the
tiny-model runs that take longer (checkpoints read back through transformers, CLI evaluations,
whole-model comparisons, Monte Carlo checks).

The tier's rule is enforced while a fast test runs, its fixtures included, in every run (CI's
whole-suite run too), by tripwires that fail the test with what it did and how to move it:
- building or loading a transformers model of more than TINY_PARAMS parameters
  (`from_pretrained` / `_from_config`, which the Auto classes, calib, evals and the streamed
  pipeline all go through): the demo model, or any real one;
- starting a Python process: `subprocess` running a Python interpreter, `infer-tool`, pytest,
  torchrun or vLLM, or a `multiprocessing` process.
In a run of the fast tier alone (`-m fast`), a fast test that takes more than FAST_CPU_S
seconds of CPU (its set-up and call) fails too: it belongs in SLOW_TESTS.
tests/test_tiers.py checks the tripwires and the lists.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SLOW_MARKERS = ("slow", "vllm")
# Whole modules: the Triton interpreter's kernel runs against float64 (seconds per shape),
# runs that start processes through helpers, the whole-model against streamed comparisons.
SLOW_MODULES = frozenset(
    {
        "test_kernels_fp4.py",
        "test_kernels_w4a16.py",
        "test_kernels_fp8.py",
        "test_kernels_mxfp8.py",
        "test_kernels_benchmark.py",
        "test_distributed_quantize.py",
        "test_streaming_memory.py",
        "test_streaming_quantize.py",
        "test_resume.py",
        "test_eval_producers.py",  # eval ppl / kld of each producer's tiny checkpoint (the first pays the imports)
    }
)
# Tests that take more than about 0.8 s of CPU a case, and tiny-model runs (quantize, read back,
# evaluate, decode) above about 0.2 s a case, measured one by one (CPU time of set-up and call)
# on the 2-core AMD EPYC this project is developed on; solvers against their references and CLI
# refusals stay fast up to about 0.8 s.
SLOW_TESTS = frozenset(
    {
        # spec-profile's batched loop and suffix draft: tiny-model decode runs
        "test_spec_batched.py::test_each_sequence_decodes_as_alone",
        "test_spec_batched.py::test_loop_table",
        "test_spec_cli.py::test_loop_table_by_batch_size",
        "test_spec_suffix.py::test_loop_is_lossless_and_replayed_by_teacher_forcing",
        # test_w4afp8.py: four tiny quantize runs (one module fixture), eval ppl, compressed-tensors read-back
        "test_w4afp8.py::test_every_int_method_writes_w4afp8_and_eval_ppl_equals_its_eval",
        "test_w4afp8.py::test_compressed_tensors_reads_our_config_and_decompresses_our_weights",
        "test_w4afp8.py::test_transformers_with_compressed_tensors_gives_our_logits",
        # test_mxfp8.py: two tiny quantize runs (one module fixture), eval ppl, transformers read-back
        "test_mxfp8.py::test_checkpoint_is_compressed_tensors_mxfp8",
        "test_mxfp8.py::test_eval_ppl_equals_quantize_eval",
        "test_mxfp8.py::test_transformers_with_compressed_tensors_reads_our_weights",
        # test_autoround.py
        "test_autoround.py::test_descent_lowers_every_block_loss_and_the_output_error",
        "test_autoround.py::test_every_format_reads_back_to_the_pipeline_weights",
        "test_autoround.py::test_same_seed_same_bytes_other_seed_other_rounding",
        "test_autoround.py::test_symmetric_checkpoint_loads_in_transformers_as_our_dequantized_model",
        # test_awq_gptq.py
        "test_awq_gptq.py::test_beats_awq_and_rtn_on_held_out_logits",
        "test_awq_gptq.py::test_checkpoint_loads_in_transformers",
        "test_awq_gptq.py::test_equals_awq_search_and_fold_then_gptq_by_hand",
        "test_awq_gptq.py::test_fp4_equals_fp4_awq_then_fp4_gptq_by_hand",
        "test_awq_gptq.py::test_gptq_hessian_is_of_the_smoothed_inputs",
        # test_awq_search.py
        "test_awq_search.py::test_screen_is_the_full_grid_without_native_bfloat16",
        "test_awq_search.py::test_tiny_architectures_fast_equals_full",
        # test_eval_quantized.py
        "test_eval_quantized.py::test_checkpoint_loads_with_quantized_modules_and_matches_dequantized_model",
        "test_eval_quantized.py::test_eval_ppl_cli_on_our_checkpoint_reports_the_backend",
        # test_fp4_quantize.py
        "test_fp4_quantize.py::test_autoround_descent_lowers_every_block_loss_on_the_fp4_grid",
        "test_fp4_quantize.py::test_gptq_beats_rtn_on_the_tiny_model",
        "test_fp4_quantize.py::test_moe_experts_share_w1_w3_scales_and_one_input_scale_per_layer",
        "test_fp4_quantize.py::test_the_clip_search_runs_as_the_format_and_flag_say",
        "test_fp4_quantize.py::test_w4a4_from_saved_statistics_and_statistics_without_ranges",
        # test_fp8_cli.py
        "test_fp8_cli.py::test_eval_kv_cache_dtype_fp8_reproduces_quantize_eval",
        "test_fp8_cli.py::test_native_block_checkpoint",
        "test_fp8_cli.py::test_static_kv_checkpoint_loads_and_reports",
        # test_fp8_formats.py
        "test_fp8_formats.py::test_compressed_tensors_checkpoint_loads_in_transformers",
        "test_fp8_formats.py::test_kv_amax_is_what_the_cache_stores_after_rope",
        "test_fp8_formats.py::test_native_block_checkpoint_loads_in_transformers",
        "test_fp8_formats.py::test_simulated_fp8_kv_cache_stores_e4m3_rounded_keys",
        # test_fp8_pipeline.py
        "test_fp8_pipeline.py::test_fp8_runtime_runs_w8a8_and_restores",
        "test_fp8_pipeline.py::test_static_activations_and_kv_scales_match_a_plain_rerun",
        "test_fp8_pipeline.py::test_write_and_read_back_through_the_registry",
        # test_full_range.py
        "test_full_range.py::test_autoround_takes_the_full_range_grid_by_default_for_symmetric_groups_only",
        "test_full_range.py::test_every_method_writes_signed_scales_that_transformers_reads",
        # test_gptaq.py
        "test_gptaq.py::test_awq_gptq_pairs_in_the_folded_basis",
        "test_gptaq.py::test_pipeline_pairs_the_chains_chunk_by_chunk",
        # test_hostile.py
        "test_hostile.py::test_checkpoint_files_are_readable_by_others",
        "test_hostile.py::test_ignore_pattern_matching_nothing_is_reported",
        "test_hostile.py::test_no_progress_silences_library_bars",
        # test_imports.py
        "test_imports.py::test_no_import_cycles",
        # test_kld.py
        "test_kld.py::test_cli_json_contract",
        "test_kld.py::test_cli_quantized_checkpoint",
        "test_kld.py::test_cli_table_and_self_reference",
        "test_kld.py::test_evaluate_kld_direction_summary_and_ppl",
        "test_kld.py::test_model_against_itself_is_exactly_zero",
        "test_kld.py::test_token_kl_equals_the_written_out_sum",
        # test_models_corpora.py
        "test_models_corpora.py::test_gguf_conversion_parses_the_file_once_and_restores_gguf",
        # test_moe_cli.py
        "test_moe_cli.py::test_checkpoint_names_report_and_our_loader",
        "test_moe_cli.py::test_spec_profile_with_quantized_moe_draft",
        "test_moe_cli.py::test_transformers_reads_fp8_experts",
        "test_moe_cli.py::test_transformers_reads_int4_experts",
        # test_moe_pipeline.py
        "test_moe_pipeline.py::test_every_expert_quantized_and_gptq_awq_beat_rtn",
        "test_moe_pipeline.py::test_starved_expert",
        # test_packers_formats.py
        "test_packers_formats.py::test_compressed_tensors_checkpoint_loads_in_plain_transformers",
        "test_packers_formats.py::test_deterministic_bytes",
        # test_packers_solvers.py
        "test_packers_solvers.py::test_awq_beats_rtn_on_salient_channels",
        "test_packers_solvers.py::test_observer_reaches_rtn_and_gptq_scales",
        # test_pipeline.py
        "test_pipeline.py::test_quantize_all_methods_run_and_gptq_beats_rtn",
        # test_ppl.py
        "test_ppl.py::test_cli_baseline_uses_identical_windows",
        "test_ppl.py::test_cli_json_is_one_document_with_the_contract",
        "test_ppl.py::test_ppl_matches_transformers_loss_and_is_deterministic",
        # test_ppl_cache.py
        "test_ppl_cache.py::test_eval_ppl_baseline_reads_the_cache",
        "test_ppl_cache.py::test_quantize_eval_reads_the_baseline_on_its_second_run",
        # test_presets.py
        "test_presets.py::test_preset_checkpoint_equals_the_explicit_flags_and_old_stats_refuse_smoothquant",
        # test_quantize_cli.py
        "test_quantize_cli.py::test_asymmetric_awq_checkpoint_equals_in_process_pipeline",
        "test_quantize_cli.py::test_calibrate_then_quantize_with_stats",
        "test_quantize_cli.py::test_compressed_tensors_checkpoint_loads_in_transformers",
        "test_quantize_cli.py::test_deterministic_bytes_and_other_formats",
        "test_quantize_cli.py::test_gptq_default_is_static_act_order",
        "test_quantize_cli.py::test_quality_gate_exit_3",
        "test_quantize_cli.py::test_recipe_with_flag_override",
        # test_quantize_kld.py
        "test_quantize_kld.py::test_a_cached_ppl_without_hidden_states_runs_the_fp_pass",
        "test_quantize_kld.py::test_max_kld_gate_exits_3_alone_or_with_the_ppl_gate",
        "test_quantize_kld.py::test_report_kld_equals_eval_kld_of_the_checkpoint",
        "test_quantize_kld.py::test_second_run_reads_the_fp_hidden_states",
        # test_smoothquant.py
        "test_smoothquant.py::test_smoothquant_in_gptq_and_rtn_live_and_from_saved_statistics",
        # test_spec_cli.py
        "test_spec_cli.py::test_cost_ratio_override_and_table",
        "test_spec_cli.py::test_job_runs_as_a_library",
        "test_spec_cli.py::test_json_contract",
        "test_spec_cli.py::test_no_loop_screening_ranks_by_prediction",
        "test_spec_cli.py::test_per_category_and_identical_draft",
        "test_spec_cli.py::test_projection_and_kv_budget_reads_the_report",
        # test_spec_decode.py
        "test_spec_decode.py::test_greedy_accepted_lengths_follow_teacher_forced_beta",
        "test_spec_decode.py::test_greedy_output_identical_for_every_draft",
        "test_spec_decode.py::test_matches_transformers_assisted_generation",
        "test_spec_decode.py::test_sampled_loop_and_profile",
        # test_spec_predict.py
        "test_spec_predict.py::test_profile_follows_fake_timing",
        # test_spec_sampling.py
        "test_spec_sampling.py::test_one_step_reproduces_p",
        "test_spec_sampling.py::test_two_step_block_reproduces_p_pairs",
        # test_spill.py
        "test_spill.py::test_gptq_spilled_equals_in_memory",
        # test_w8a8.py
        "test_w8a8.py::test_config_is_llm_compressors_int_quantized",
        "test_w8a8.py::test_eval_ppl_quantizes_activations_as_quantize_eval_did",
    }
)
PROCESS_WORDS = re.compile(r"\bsubprocess\b|\bsys\.executable\b|\bmultiprocessing\b|\bPopen\b|\btorchrun\b")
# A started program is a Python process when its file name matches.
PYTHON_PROGRAMS = re.compile(r"^(python[0-9.]*|infer-tool|pytest|py\.test|torchrun|vllm)$")
TINY_PARAMS = 2_000_000  # the tests' tiny random models have at most a few hundred thousand
FAST_CPU_S = 10.0  # generous: on the loaded shared machine a 0.3 s test once took 4.3 s of CPU


@functools.cache
def _source(fn: Callable) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _names(code: types.CodeType) -> set[str]:
    """Global names `code` and the code nested in it (comprehensions, lambdas) refer to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _under_tests(fn: Callable) -> bool:
    try:
        return Path(inspect.getsourcefile(fn) or "/").resolve().is_relative_to(TESTS)
    except TypeError:
        return False


@functools.cache
def _starts_process(fn: Callable, depth: int = 2) -> bool:
    """`fn`'s source, or that of a function of its module or of tests/ that it calls (`depth`
    calls deep), names a way to start a process."""
    if PROCESS_WORDS.search(_source(fn)):
        return True
    code = getattr(fn, "__code__", None)
    if depth == 0 or code is None:
        return False
    module_globals = getattr(fn, "__globals__", {})
    for name in _names(code):
        other = module_globals.get(name)
        if (
            isinstance(other, types.FunctionType)
            and other is not fn
            and (other.__module__ == fn.__module__ or _under_tests(other))
            and _starts_process(other, depth - 1)
        ):
            return True
    return False


def slow_reason(item: pytest.Item) -> str | None:
    """Why `item` is not in the fast tier, or None when it is."""
    for marker in SLOW_MARKERS:
        if item.get_closest_marker(marker) is not None:
            return f"marked {marker}"
    path = Path(item.path)
    if path.name in SLOW_MODULES:
        return "its module is in SLOW_MODULES"
    base = f"{path.name}::{getattr(item, 'originalname', item.name)}"
    if base in SLOW_TESTS:
        return "it is in SLOW_TESTS"
    if isinstance(item, pytest.Function) and _starts_process(item.function):
        return "it starts a process"
    info = getattr(item, "_fixtureinfo", None)
    for name, defs in (info.name2fixturedefs if info else {}).items():
        for fd in defs:
            if _under_tests(fd.func) and _starts_process(fd.func):
                return f"its fixture {name} starts a process"
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "fast: given by tests/conftest.py, never by hand: the fast tier (`pytest -m fast`, make test-fast)"
    )
    _install_process_tripwires()


@pytest.fixture(autouse=True, scope="module")
def _torch_threads_kept(request: pytest.FixtureRequest):
    """Each module leaves torch's intra-op thread count as it found it: a leak (spec-profile's
    `--threads` once did) runs every later module of the suite on fewer cores, unnoticed."""
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    yield
    if before is not None and torch.get_num_threads() != before:
        left = torch.get_num_threads()
        torch.set_num_threads(before)
        pytest.fail(
            f"{request.module.__name__} left torch's threads at {left} (found {before}): restore them "
            "(common/device.cpu_threads)",
            pytrace=False,
        )


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if slow_reason(item) is None:
            item.add_marker(pytest.mark.fast)


def pytest_collection_finish(session: pytest.Session) -> None:
    if any(item.get_closest_marker("fast") for item in session.items):
        install_model_tripwires()


# --- the tripwires -------------------------------------------------------------------------
_armed: list[str] = []  # the node id of the fast test now running
_violations: dict[str, list[str]] = {}


class TierViolation(pytest.fail.Exception):
    """A fast test did what the fast tier excludes (a BaseException: library code that turns
    `Exception` into BadInput, and CliRunner, let it through)."""


def trip(what: str) -> None:
    """Fail the fast test now running, if any, for doing `what`."""
    if not _armed:
        return
    nodeid = _armed[-1]
    _violations.setdefault(nodeid, []).append(what)
    raise TierViolation(
        f"{nodeid} is in the fast tier but {what}: move it to the slow tier "
        "(@pytest.mark.slow, or SLOW_TESTS / SLOW_MODULES in tests/conftest.py)",
        pytrace=False,
    )


@contextlib.contextmanager
def armed(nodeid: str) -> Iterator[None]:
    """The tripwires fire inside this block as for the fast test `nodeid`."""
    _armed.append(nodeid)
    try:
        yield
    finally:
        _armed.pop()


def _program(args: object) -> str:
    if isinstance(args, (str, bytes, Path)):
        words = str(args).split()
    else:
        words = [str(a) for a in (args or [])]
    return Path(words[0]).name if words else ""


def _install_process_tripwires() -> None:
    popen_init = subprocess.Popen.__init__
    if getattr(popen_init, "tier_tripwire", False):
        return

    def guarded_popen(self, args, *a, **kw):
        program = _program(kw.get("executable") or args)
        if PYTHON_PROGRAMS.match(program) or program == Path(sys.executable).name:
            trip(f"started a Python process ({program})")
        return popen_init(self, args, *a, **kw)

    import multiprocessing.process

    start = multiprocessing.process.BaseProcess.start

    def guarded_start(self):
        trip("started a multiprocessing process")
        return start(self)

    guarded_popen.tier_tripwire = guarded_start.tier_tripwire = True
    subprocess.Popen.__init__ = guarded_popen
    multiprocessing.process.BaseProcess.start = guarded_start


def install_model_tripwires() -> None:
    """Wrap `PreTrainedModel.from_pretrained` and `._from_config`: the Auto classes'
    `from_pretrained` / `from_config` and every model class's call them."""
    from transformers.modeling_utils import PreTrainedModel

    for name in ("from_pretrained", "_from_config"):
        inner = PreTrainedModel.__dict__[name].__func__
        if getattr(inner, "tier_tripwire", False):
            continue

        def guarded(cls, *a, _inner=inner, _name=name, **kw):
            model = _inner(cls, *a, **kw)
            if _armed:
                n = sum(p.numel() for p in model.parameters())
                if n > TINY_PARAMS:
                    trip(f"loaded a model of {n:,} parameters ({cls.__name__}.{_name})")
            return model

        guarded.tier_tripwire = True
        setattr(PreTrainedModel, name, classmethod(guarded))


def _fast_run(config: pytest.Config) -> bool:
    return (config.getoption("markexpr", "") or "").strip() == "fast"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    return (yield from _guarded(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    return (yield from _guarded(item, "call"))


_cpu: dict[str, float] = {}


def _guarded(item: pytest.Item, phase: str):
    if item.get_closest_marker("fast") is None:
        return (yield)
    t0 = time.process_time()
    with armed(item.nodeid):
        result = yield
    if _violations.get(item.nodeid):  # tripped, and the test swallowed it
        pytest.fail(f"{item.nodeid} is in the fast tier but {_violations[item.nodeid][0]}", pytrace=False)
    cpu = _cpu[item.nodeid] = _cpu.get(item.nodeid, 0.0) + time.process_time() - t0
    if phase == "call" and cpu > FAST_CPU_S and _fast_run(item.config):
        pytest.fail(
            f"{item.nodeid} is in the fast tier but took {cpu:.1f} s of CPU (set-up and call; the tier allows "
            f"{FAST_CPU_S:g} s a test): add it to SLOW_TESTS in tests/conftest.py",
            pytrace=False,
        )
    return result
