"""Shared by the MoE tests: the Kimi shapes, a tiny expert layout, and case builders."""

import torch

from decodebench.kernels.experts import MoEStage
from decodebench.kernels.int4 import ExpertLayout
from decodebench.kernels.moe import MoECase, RoutingDistribution, moe_cases
from decodebench.model import load_model_spec
from decodebench.shapes import DecodeShapes, GemmShape, sweep_for

CPU = torch.device("cpu")
KIMI = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), tp=8)
TINY = ExpertLayout(12, GemmShape(64, 32), GemmShape(32, 32), group_size=16)
MARLIN_SHAPED = ExpertLayout(16, GemmShape(128, 128), GemmShape(128, 64), group_size=32)
STAGES = list(MoEStage)
ROUTINGS = [RoutingDistribution.UNIFORM, RoutingDistribution.SKEWED]  # the drawn ones (profile: replayed)


def tiny(stage=MoEStage.FUSED, tokens=5, routing=RoutingDistribution.UNIFORM):
    return MoECase(stage, tokens, TINY, top_k=4, routing=routing, check_experts=12)


def kimi(stage=MoEStage.FUSED, tokens=1, routing=RoutingDistribution.UNIFORM):
    (case,) = [c for c in moe_cases(KIMI, sweep_for("nightly"))
               if (c.stage, c.tokens, c.routing) == (stage, tokens, routing)]
    return case
