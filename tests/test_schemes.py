"""The scheme contract (`schemes/`) and the quantizer registry keyed by scheme type."""

from __future__ import annotations

import dataclasses
import json

import pytest

from infer_tool.calib.quantizers import quantizer_for, register_quantizer
from infer_tool.calib.quantizers.base import LayerQuantizer
from infer_tool.calib.quantizers.gptq import GPTQQuantizer
from infer_tool.common.errors import BadInput
from infer_tool.formats.registry import all_formats
from infer_tool.schemes.base import Scheme
from infer_tool.schemes.fp8 import Fp8Scheme
from infer_tool.schemes.integer import GPTQScheme, RTNScheme
from infer_tool.schemes.registry import SCHEMES, all_schemes, make_scheme, scheme_fields, scheme_from_dict

EVERY_CLASS = list(all_schemes())


@pytest.mark.parametrize(("method", "cls"), EVERY_CLASS, ids=[c.__name__ for _, c in EVERY_CLASS])
def test_every_scheme_round_trips_through_its_dict(method: str, cls: type) -> None:
    """to_dict is JSON-able, names the method and every option; from_dict gives the scheme
    back; the method's default class needs no option, another format's class is picked by
    its own options (those of its format's first preset: FP4's `fp4`, MXFP8's `mxfp8_activations`)."""
    fmt = next(f for f in all_formats() if cls in f.schemes)
    own = {} if SCHEMES[method] is cls else dict(fmt.presets[0].options)
    scheme = make_scheme(method, **own)
    assert type(scheme) is cls and isinstance(scheme, Scheme) and scheme.method == method
    d = json.loads(json.dumps(scheme.to_dict()))
    assert d["method"] == method and set(d) == {"method", *cls.option_names()}
    assert set(d) - {"method"} <= set(scheme_fields(method))
    assert scheme_from_dict(d) == scheme
    assert type(scheme).from_dict(d) == scheme


def test_non_default_options_round_trip() -> None:
    fp8 = make_scheme("fp8", granularity="block", block_size=(64, 32), clip_search=True)
    assert fp8.to_dict()["block_size"] == [64, 32]
    assert scheme_from_dict(json.loads(json.dumps(fp8.to_dict()))) == fp8
    gptq = make_scheme("gptq", bits=3, group_size=-1, act_order=False, damp=0.05)
    assert scheme_from_dict(gptq.to_dict()) == gptq


def test_make_scheme_keeps_defaults_for_none_and_refuses_what_does_not_apply() -> None:
    assert make_scheme("gptq", group_size=None, damp=None) == GPTQScheme()
    with pytest.raises(BadInput, match=r"options \['granularity'\] do not apply to method 'gptq'"):
        make_scheme("gptq", granularity="tensor")
    with pytest.raises(
        BadInput, match="method 'int3' is not supported; use one of rtn, gptq, awq, awq\\+gptq, autoround, fp8"
    ):
        make_scheme("int3")
    with pytest.raises(BadInput, match="a 'gptq' scheme is not a 'fp8' scheme"):
        Fp8Scheme.from_dict(GPTQScheme().to_dict())
    with pytest.raises(BadInput, match="needs a method string"):
        scheme_from_dict({"bits": 4})


def test_option_defaults_are_the_dataclass_defaults() -> None:
    for cls in SCHEMES.values():
        assert cls.option_defaults() == {f.name: f.default for f in dataclasses.fields(cls)}
        assert cls.option_names() == tuple(f.name for f in dataclasses.fields(cls))


def test_a_scheme_must_implement_the_contract() -> None:
    @dataclasses.dataclass(frozen=True)
    class Half(Scheme):
        method = "half"
        kind = "half"

        def describe(self) -> str:
            return "half"

    with pytest.raises(TypeError, match="abstract"):
        Half()


def test_every_registered_scheme_has_a_quantizer_of_its_type() -> None:
    for cls in SCHEMES.values():
        quantizer = quantizer_for(cls())
        assert isinstance(quantizer, LayerQuantizer)
    assert isinstance(quantizer_for(GPTQScheme()), GPTQQuantizer)


def test_quantizers_are_keyed_by_exact_type() -> None:
    """A scheme subclass without its own quantizer is refused, not run by its parent's."""

    @dataclasses.dataclass(frozen=True)
    class SlowRTN(RTNScheme):
        method = "slow-rtn"

    with pytest.raises(BadInput, match=r"no layer quantizer is registered for method 'slow-rtn' \(SlowRTN\)"):
        quantizer_for(SlowRTN())
    with pytest.raises(ValueError, match="GPTQScheme already has the quantizer GPTQQuantizer"):

        @register_quantizer(GPTQScheme)
        class Other(LayerQuantizer[GPTQScheme]):
            pass


# ---- method configs composed with formats; options declared once (schemes/methods.py, options.py)


def test_an_option_declared_twice_is_an_error() -> None:
    from infer_tool.schemes.options import declared_options, option

    @dataclasses.dataclass(frozen=True)
    class A:
        x: int = option(1, "one")

    @dataclasses.dataclass(frozen=True)
    class B:
        y: int = option(2, "two", name="x")

    assert set(declared_options([A])) == {"x"}
    with pytest.raises(ValueError, match="'x' is declared twice"):
        declared_options([A, B])


def test_every_quantize_scheme_option_sets_a_field_of_some_scheme() -> None:
    """Each option the CLI offers for a scheme is a field of at least one registered class, and
    each class's declared fields are offered: the flags and the schemes cannot drift apart."""
    from infer_tool.calib.recipe import OPTIONS

    targets = {name: f.metadata["scheme"] for name, f in OPTIONS.items() if f.metadata["scheme"]}
    fields = {f.name for _, cls in all_schemes() for f in dataclasses.fields(cls)}
    assert targets and set(targets.values()) <= fields
    declared = {
        f.name for _, cls in all_schemes() for f in dataclasses.fields(cls) if f.metadata.get("option") is not None
    }
    assert declared == set(targets.values())


@pytest.mark.parametrize(
    ("method", "bad", "message"),
    [
        ("gptq", {"damp": 0.0}, "damp=0.0 is not supported"),
        ("gptq", {"block_size": 0}, "block_size=0 is not supported"),
        ("awq", {"search": "grid"}, "AWQ search 'grid' is not supported"),
        ("autoround", {"iters": 0}, "--iters 0 is not supported"),
        ("autoround", {"tune_dtype": "float16"}, "--tune-dtype 'float16' is not supported"),
    ],
)
def test_a_methods_checks_hold_in_every_format_it_rounds_to(method: str, bad: dict, message: str) -> None:
    """The config's own check runs whatever format it is composed with (INT, FP4, MXFP8)."""
    formats = [{}, {"fp4": "nvfp4"}] + ([{"mxfp8_activations": "none"}] if method == "gptq" else [])
    for fmt in formats:
        with pytest.raises(BadInput, match=message):
            make_scheme(method, **fmt, **bad)
        assert make_scheme(method, **fmt).to_dict()["method"] == method  # the format alone is accepted
