"""The component registry: every component declares every fact, and every table is derived from it."""

from __future__ import annotations

import json
import sys
import textwrap
from dataclasses import fields
from pathlib import Path

import pytest

from decodebench import registry
from decodebench.kernel_rules import parts
from decodebench.model import load_model_spec
from decodebench.registry import UNSAID, ComponentSpec, Per, RegistryError
from decodebench.shapes import DecodeShapes

REPO = Path(__file__).resolve().parent.parent
KIMI8 = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8)


def _stored_entries() -> dict[str, list[dict]]:
    """Every committed result of a registered component (baselines/), by component."""
    out: dict[str, list[dict]] = {}
    for path in sorted((REPO / "baselines").rglob("*.json")):
        for bench in json.loads(path.read_text())["benchmarks"]:
            info = bench.get("extra_info") or {}
            out.setdefault(info.get("component"), []).append(info)
    return out


STORED = _stored_entries()


@pytest.mark.parametrize("spec", registry.registered(), ids=lambda s: s.name)
def test_every_registered_component_declares_every_fact(spec):
    for f in fields(spec):
        assert getattr(spec, f.name) is not UNSAID, f"component {spec.name}: no {f.name}"
    assert spec.case.component == spec.name
    assert set(spec.parts) <= set(parts()), f"component {spec.name}: parts {spec.parts} the breakdown does not have"


@pytest.mark.parametrize("spec", registry.registered(), ids=lambda s: s.name)
def test_every_fact_answers_for_the_committed_results_of_its_component(spec):
    stored = STORED.get(spec.name, [])
    if not stored:  # registered before a GPU run stored its results: its own test checks its cases' shapes
        pytest.skip(f"no committed result of {spec.name} yet to check its facts against")
    for info in stored:
        shape = info["shape"]
        if spec.name == "allreduce" and shape.get("tokens") is None:
            continue  # a point of the power-of-two sweep: no decode step runs it
        assert spec.calls_per_step(KIMI8, shape) >= 0
        assert isinstance(spec.fits_at(KIMI8, shape, info), bool)
        assert spec.tokens_at(shape) > 0
        if spec.state_bytes is not None:
            assert 0 <= spec.state(shape, info) <= info["bytes_read"] + info["bytes_written"]


def test_a_component_that_leaves_a_fact_out_is_refused_naming_both():
    full = {f.name: getattr(registry.get("rmsnorm"), f.name) for f in fields(ComponentSpec)}
    for fact in ("group", "identity", "per", "parts", "calls", "state_bytes", "tokens", "fits", "launches",
                 "step_cases"):
        with pytest.raises(RegistryError, match=f"^component rmsnorm: no {fact}$"):
            ComponentSpec(**{k: v for k, v in full.items() if k != fact})
    assert ComponentSpec(**{**full, "state_bytes": None}).state_bytes is None  # said: a collective


def test_a_question_about_an_unknown_component_or_a_shape_without_a_fact_is_an_error_naming_it():
    with pytest.raises(RegistryError, match="'rotary_embedding' is not registered"):
        registry.calls_per_step(KIMI8, "rotary_embedding", {})
    with pytest.raises(RegistryError, match="component rmsnorm: calls per step: .*fused_add"):
        registry.calls_per_step(KIMI8, "rmsnorm", {"role": "hidden"})
    with pytest.raises(RegistryError, match="component dense_gemm: calls per step: .*op 'rotary'"):
        registry.calls_per_step(KIMI8, "dense_gemm", {"op": "rotary"})
    with pytest.raises(RegistryError, match="component mla_decode: state bytes: .*head_dim"):
        registry.get("mla_decode").state({"context_total": 8, "kv_dtype": "bfloat16"}, {})
    with pytest.raises(RegistryError, match="component allreduce: no state bytes"):
        registry.get("allreduce").state({}, {})


CORE_GROUPS = {"moe": ("moe_gemm", "moe_glue"), "routing": ("routing",), "mla_attention": ("mla_attention",),
               "dense_gemm": ("dense_gemm",), "allreduce": ("allreduce",), "rmsnorm": ("rmsnorm",)}


def test_the_tables_derived_from_the_registry():
    # the groups of the first components as they were; one a component adds is its parts, in display order
    groups = registry.group_parts()
    assert {g: p for g, p in groups.items() if g in CORE_GROUPS} == CORE_GROUPS
    for group, group_parts in groups.items():
        owned = {p for spec in registry.registered() if spec.group == group for p in spec.parts}
        assert group_parts == tuple(p for p in parts() if p in owned)
    assert registry.group_components()["dense_gemm"] == ("dense_gemm", "router_gemm")
    projected = registry.projected_groups()
    assert [g for g in projected if g in CORE_GROUPS] == ["moe", "routing", "mla_attention", "dense_gemm", "rmsnorm"]
    assert "allreduce" not in projected  # a collective: no state bytes
    owned = {p for spec in registry.registered() for p in spec.parts}
    assert {"sampling", "copies_casts", "other"} <= set(registry.not_benchmarked())
    assert set(registry.not_benchmarked()) == set(parts()) - owned
    assert registry.part_scaling()["mla_attention"] is Per.LAYER
    assert registry.identity("dense_gemm") == ("op",)


def test_calls_per_step_of_every_component_at_kimi_tp8():
    calls = registry.calls_per_step
    assert calls(KIMI8, "moe", {"stage": "fused"}) == calls(KIMI8, "routing_topk", {}) == 60
    assert calls(KIMI8, "router_gemm", {}) == 60
    assert calls(KIMI8, "mla_decode", {}) == 61
    assert calls(KIMI8, "rmsnorm", {"role": "hidden", "fused_add": True}) == 122
    assert calls(KIMI8, "rmsnorm", {"role": "q_lora", "fused_add": False}) == 61
    assert calls(KIMI8, "dense_gemm", {"op": "q_a"}) == 61
    assert calls(KIMI8, "dense_gemm", {"op": "lm_head"}) == 1
    assert calls(KIMI8, "allreduce", {}) == 123


NEW_COMPONENT = '''
from typing import ClassVar

from decodebench.kernel_rules import Rule
from decodebench.registry import ComponentSpec, Per, StepCase, tokens_of


class KVWriteCase:
    component: ClassVar[str] = "kv_write_example"
    activation_inputs: ClassVar[tuple[str, ...]] = ("latent",)


COMPONENT = ComponentSpec(
    name="kv_write_example", group="kv_write_example", case=KVWriteCase, identity=("kv_dtype",), per=Per.LAYER,
    parts=("kv_write_example",), calls=lambda shapes, s: shapes.spec.num_layers,
    state_bytes=lambda s, info: 0, tokens=tokens_of, fits=lambda shapes, s, info: True, launches=1,
    step_cases=lambda shapes: (StepCase({}),),
    rules=(Rule("kv_write_example", r"concat_and_cache", "the KV-cache write", "kv_cache_write"),),
)
'''


def test_a_component_declared_in_a_new_module_is_found_with_its_facts(tmp_path, monkeypatch):
    package = tmp_path / "example_components"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "kv_write.py").write_text(textwrap.dedent(NEW_COMPONENT))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        (spec,) = registry.discover(("example_components",))
    finally:
        for name in [m for m in sys.modules if m.startswith("example_components")]:
            del sys.modules[name]
    assert (spec.name, spec.calls_per_step(KIMI8, {}), spec.rules[0].kind) == ("kv_write_example", 61,
                                                                                "kv_cache_write")


def test_two_declarations_of_one_component_are_refused(tmp_path, monkeypatch):
    package = tmp_path / "twice_components"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for module in ("a", "b"):
        (package / f"{module}.py").write_text(textwrap.dedent(NEW_COMPONENT))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(RegistryError, match="kv_write_example is declared twice"):
            registry.discover(("twice_components",))
    finally:
        for name in [m for m in sys.modules if m.startswith("twice_components")]:
            del sys.modules[name]
