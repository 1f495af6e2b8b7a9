import dataclasses

import pytest

from decodebench.errors import ShapeError
from decodebench.model import load_model_spec
from decodebench.shapes import DecodeShapes, GemmShape, SweepLevel, sweep_for


@pytest.fixture(scope="module")
def kimi():
    return load_model_spec("kimi-k2.5")


def test_kimi_at_tp8(kimi):
    s = DecodeShapes.for_deployment(kimi, tp=8)
    assert s.moe_gate_up == GemmShape(n=512, k=7168)
    assert s.moe_down == GemmShape(n=7168, k=256)
    assert s.router == GemmShape(n=384, k=7168)
    assert (s.experts, s.top_k) == (384, 8)
    mla = s.mla
    assert (mla.heads, mla.kv_lora_rank, mla.rope_dim, mla.head_dim, mla.page_size) == (8, 512, 64, 576, 16)
    assert s.norm_widths == {"hidden": 7168, "q_lora": 1536, "kv_lora": 512}
    assert s.allreduce_bytes(1) == 14336
    assert s.allreduce_bytes(256) == 3670016
    assert s.allreduces_per_step == 123


def test_kimi_at_tp4(kimi):
    s = DecodeShapes.for_deployment(kimi, tp=4)
    assert s.moe_gate_up == GemmShape(n=1024, k=7168)
    assert s.moe_down == GemmShape(n=7168, k=512)
    assert s.mla.heads == 16


def test_single_gpu_has_no_allreduce(kimi):
    assert DecodeShapes.for_deployment(kimi, tp=1).allreduces_per_step == 0


def test_deepseek_v3_at_tp8():
    s = DecodeShapes.for_deployment(load_model_spec("deepseek-v3"), tp=8)
    assert (s.moe_gate_up, s.moe_down, s.mla.heads, s.experts) == (GemmShape(512, 7168), GemmShape(7168, 256), 16, 256)


def test_indivisible_tp_names_the_dimension(kimi):
    with pytest.raises(ShapeError, match="num_attention_heads = 64 is not divisible by tp = 3"):
        DecodeShapes.for_deployment(kimi, tp=3)


def test_group_size_must_divide_the_per_rank_width(kimi):
    # 2048 / 32 = 64 columns per rank cannot hold a 128-wide quantization group
    coarse = dataclasses.replace(kimi, quant=dataclasses.replace(kimi.quant, group_size=128))
    with pytest.raises(ShapeError, match="moe_intermediate_size/tp = 64 is not divisible by group_size = 128"):
        DecodeShapes.for_deployment(coarse, tp=32)


@pytest.mark.parametrize("tp", [0, -8])
def test_non_positive_tp(kimi, tp):
    with pytest.raises(ShapeError, match="positive"):
        DecodeShapes.for_deployment(kimi, tp=tp)


def test_sweep_levels_grow():
    smoke, nightly, full = (sweep_for(level) for level in SweepLevel)
    assert set(smoke.tokens) <= set(nightly.tokens) <= set(full.tokens)
    assert nightly.tokens == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert nightly.contexts == (1024, 8192, 32768, 131072)
    with pytest.raises(ValueError, match="weekly"):
        sweep_for("weekly")
