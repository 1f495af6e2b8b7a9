"""MoE routing beyond the benchmark's own draws: the distributions shared with the server's routing
simulator, routing profiles (read, checked, replayed), and the environment that makes a started
server load decodebench's vLLM plugin. No server here (tests/test_attribution_e2e.py runs one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decodebench.attribution.depth import with_layers
from decodebench.attribution.predict.prediction import predict_step
from decodebench.errors import ShapeError
from decodebench.kernels.moe import MoECase, moe_cases
from decodebench.model import load_model_spec
from decodebench.moe_routing import (
    PROFILE_FORMAT,
    ROUTING_PROFILE_ENV,
    LayerRouting,
    RoutingDistribution,
    RoutingProfile,
    RoutingProfileError,
    draw_experts,
    expected_distinct,
    load_routing_profile,
    profile_from_captures,
    write_routing_profile,
)
from decodebench.results import results_of
from decodebench.serving.server_routing import DIST_INFO, ServerRouting, default_routing, plugin_dir, server_env
from decodebench.serving.vllm_plugin import CAPTURE_ENV, SERVER_ROUTING_ENV, SIMULATOR_ENV
from decodebench.shapes import DecodeShapes, sweep_for

KIMI1 = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), tp=1)


def test_skewed_draws_put_three_quarters_of_the_slots_on_the_hot_set_uniform_draws_spread():
    gen = torch.Generator().manual_seed(1)
    skewed = draw_experts(64, 384, 8, "skewed", generator=gen)
    assert (skewed < 16).sum().item() == 64 * 6  # 6 of 8 slots per token in experts 0..15
    uniform = draw_experts(64, 384, 8, "uniform", generator=gen)
    for ids in (skewed, uniform):
        assert all(len(set(row.tolist())) == 8 for row in ids)  # distinct per token
    assert len(set(uniform.flatten().tolist())) > len(set(skewed.flatten().tolist()))


def test_a_profile_draw_follows_the_captured_frequencies():
    counts = [0] * 8 + [100] * 8  # only experts 8..15 were ever routed to
    ids = draw_experts(32, 16, 4, RoutingDistribution.PROFILE, weights=counts, generator=torch.Generator())
    assert ids.min().item() >= 8
    assert expected_distinct(counts, tokens=32, top_k=4) == pytest.approx(8.0)
    with pytest.raises(ValueError, match="pass weights"):
        draw_experts(1, 16, 4, RoutingDistribution.PROFILE)


def profile_file(tmp_path: Path, experts=384, top_k=8, layers=(1, 2, 3)) -> Path:
    hot = [100] * 16 + [0] * (experts - 16)  # 16 experts take every slot
    profile = RoutingProfile("kimi-k2.5", experts, top_k, tuple(LayerRouting(i, tuple(hot), 200) for i in layers))
    return write_routing_profile(tmp_path / "routing.json", profile)


def test_a_profile_round_trips_and_a_bad_one_is_named(tmp_path):
    path = profile_file(tmp_path)
    profile = load_routing_profile(path)
    assert [r.layer for r in profile.layers] == [1, 2, 3]
    assert profile.layers[0].experts_seen == 16
    data = json.loads(path.read_text())
    data["layers"][1]["layer"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(RoutingProfileError, match="a layer appears twice"):
        load_routing_profile(path)
    path.write_text("[]")
    with pytest.raises(RoutingProfileError, match=f"not a decodebench routing profile .*{PROFILE_FORMAT}"):
        load_routing_profile(path)


def test_the_moe_benchmark_replays_each_captured_layer_at_every_token_count(tmp_path, monkeypatch):
    monkeypatch.setenv(ROUTING_PROFILE_ENV, str(profile_file(tmp_path)))
    replayed = [c for c in moe_cases(KIMI1, sweep_for("smoke")) if c.routing is RoutingDistribution.PROFILE]
    assert [c.id for c in replayed][:2] == ["fused-e384-top8-g32-n4096k7168-n7168k2048-profile-l1-m1",
                                            "fused-e384-top8-g32-n4096k7168-n7168k2048-profile-l1-m8"]
    assert len(replayed) == 3 * 2
    m8 = replayed[1]
    assert m8.distinct_experts <= 16  # only the 16 captured experts are drawn, never relabeled
    ids, _ = m8.route(seed=7)
    assert ids.max().item() < 16
    assert m8.check_variant().routing is RoutingDistribution.UNIFORM  # the numerics check, at fewer experts
    assert m8.shape()["layer"] == 1
    assert m8.shape()["profile_experts_seen"] == 16


def test_a_profile_of_another_model_is_refused_by_the_case_factory(tmp_path, monkeypatch):
    monkeypatch.setenv(ROUTING_PROFILE_ENV, str(profile_file(tmp_path, experts=256)))
    with pytest.raises(RoutingProfileError, match="captured with 256 experts, top-8 .*kimi-k2.5 has 384 experts"):
        moe_cases(KIMI1, sweep_for("smoke"))


def test_a_replayed_profile_is_predicted_layer_by_layer(tmp_path, monkeypatch):
    monkeypatch.setenv(ROUTING_PROFILE_ENV, str(profile_file(tmp_path)))
    cases = [c for c in moe_cases(KIMI1, sweep_for("smoke")) if c.routing is RoutingDistribution.PROFILE]
    results = results_of({"name": c.id, "extra_info": {"component": "moe", "backend": "vllm",
                                                      "shape": c.shape()},
                          "stats": {"median": c.profile.layer * 1e-4}} for c in cases)
    four = with_layers(load_model_spec("kimi-k2.5"), 4)  # MoE layers 1, 2, 3: each its own result
    moe = [t for t in predict_step(results, four, 1, 8, 1024, "model").terms if t.group == "moe"]
    assert [(t.per_call_us, t.calls) for t in moe] == [(100.0, 1), (200.0, 1), (300.0, 1)]
    full = [t for t in predict_step(results, load_model_spec("kimi-k2.5"), 1, 8, 1024, "model").terms
            if t.group == "moe"]
    assert [(t.per_call_us, t.calls) for t in full] == [(pytest.approx(200.0), 60)]  # the mean stands for all


def test_routing_counts_of_the_server_plugin_become_a_profile():
    dump = {"rank": 0, "routers": [{"router": 0, "experts": 4, "top_k": 2, "counts": [3, 1, 2, 0], "invalid": 0}]}
    profile = profile_from_captures([dump], "m", first_moe_layer=1)
    assert profile.layers == (LayerRouting(1, (3, 1, 2, 0), 3),)
    with pytest.raises(RoutingProfileError, match="no routing capture"):
        profile_from_captures([], "m", 1)


def test_the_started_server_gets_the_plugin_and_the_simulator_only_when_asked(tmp_path):
    assert default_routing("dummy") is ServerRouting.UNIFORM
    assert default_routing("auto") is ServerRouting.MODEL
    assert server_env(ServerRouting.MODEL, plugins=None) == {}
    env = server_env(ServerRouting.SKEWED, plugins=tmp_path, capture_dir=tmp_path / "t",
                     base={"PYTHONPATH": "/elsewhere", "VLLM_PLUGINS": "other"})
    assert env[SIMULATOR_ENV] == "decodebench_skewed"
    assert env[SERVER_ROUTING_ENV] == "skewed"
    assert env[CAPTURE_ENV] == str(tmp_path / "t")
    assert env["PYTHONPATH"].split(":")[0] == str(tmp_path)
    assert env["PYTHONPATH"].endswith("/elsewhere")
    assert env["VLLM_PLUGINS"] == "other,decodebench"  # an allow-list gets ours added
    model_capture = server_env(ServerRouting.MODEL, plugins=tmp_path, capture_dir=tmp_path)
    assert SIMULATOR_ENV not in model_capture
    assert model_capture[SERVER_ROUTING_ENV] == "model"


def test_the_generated_dist_info_makes_the_entry_point_visible_to_another_process(tmp_path):
    plugin_dir(tmp_path)
    assert (tmp_path / DIST_INFO / "METADATA").is_file()
    probe = ("from importlib.metadata import entry_points; "
             "print([e.value for e in entry_points(group='vllm.general_plugins') if e.name == 'decodebench'])")
    env = {"PYTHONPATH": server_env(ServerRouting.UNIFORM, plugins=tmp_path, base={})["PYTHONPATH"]}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['decodebench.serving.vllm_plugin:register']"


def test_a_moe_case_is_told_apart_by_the_replayed_layer():
    layer = LayerRouting(3, tuple([1] * 16), 4)
    case = MoECase("fused", 2, _tiny_layout(), 4, "profile", 16, profile=layer)
    assert case.id.endswith("-profile-l3-m2")
    with pytest.raises(ShapeError, match="needs routing 'profile' and its layer"):
        MoECase("fused", 2, _tiny_layout(), 4, "uniform", 16, profile=layer)


def _tiny_layout():
    from decodebench.kernels.int4 import ExpertLayout
    from decodebench.shapes import GemmShape

    return ExpertLayout(16, GemmShape(128, 128), GemmShape(128, 64), group_size=32)
