"""The checkpoint's INT4 expert format: packing, unpacking, dequantization, random weights."""

import dataclasses

import pytest
import torch
from moe_helpers import CPU, TINY

from decodebench.errors import ShapeError
from decodebench.kernels.int4 import ExpertLayout, dequantize, expert_weights, random_expert_weights, unpack_int4
from decodebench.shapes import GemmShape


def pack_plainly(q: torch.Tensor) -> torch.Tensor:
    """Pack int values -8..7 along the last dim, 8 per int32, low nibble first, stored as q + 8."""
    rows = []
    for row in q.tolist():
        words = [sum((v + 8) << (4 * i) for i, v in enumerate(row[j:j + 8])) for j in range(0, len(row), 8)]
        rows.append([w - (1 << 32) if w >= 1 << 31 else w for w in words])
    return torch.tensor(rows, dtype=torch.int32)


def random_int4(rows, cols, seed):
    return torch.randint(-8, 8, (rows, cols), generator=torch.Generator().manual_seed(seed))


# --- packing and dequantization -------------------------------------------------------


def test_unpack_inverts_plain_packing():
    q = random_int4(5, 64, seed=0)
    assert torch.equal(unpack_int4(pack_plainly(q)), q.to(torch.bfloat16))


def test_plain_packing_is_the_checkpoint_format():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q = random_int4(6, 32, seed=1)
    assert torch.equal(helpers.pack_to_int32(q.to(torch.int8), 4), pack_plainly(q))


def test_dequantize_against_a_plainly_computed_matrix():
    q = random_int4(3, 32, seed=2)
    scales = torch.tensor([[0.5, 0.25], [1.5, 2.0], [0.125, 3.0]], dtype=torch.bfloat16)
    plain = torch.tensor([[v * float(scales[n, k // 16]) for k, v in enumerate(row)]
                          for n, row in enumerate(q.tolist())])
    packed = pack_plainly(q)
    assert torch.equal(dequantize(packed, scales, 16, torch.float32), plain)
    assert torch.equal(dequantize(packed, scales, 16, torch.bfloat16), plain.to(torch.bfloat16))


def test_dequantize_keeps_leading_expert_dims():
    weights = random_expert_weights(TINY, CPU, seed=3)
    batched = dequantize(weights.w2_packed, weights.w2_scale, TINY.group_size)
    assert batched.shape == (TINY.experts, TINY.down.n, TINY.down.k)
    assert torch.equal(batched[7], dequantize(weights.w2_packed[7], weights.w2_scale[7], TINY.group_size))


def test_random_weights_are_in_checkpoint_layout_and_not_zero():
    w = random_expert_weights(TINY, CPU, seed=4)
    assert (w.w13_packed.shape, w.w13_packed.dtype) == ((12, 64, 4), torch.int32)
    assert (w.w13_scale.shape, w.w13_scale.dtype) == ((12, 64, 2), torch.bfloat16)
    assert (w.w2_packed.shape, w.w2_scale.shape) == ((12, 32, 4), (12, 32, 2))
    assert set(unpack_int4(w.w13_packed).unique().tolist()) == set(range(-8, 8))
    assert (w.w13_scale > 0).all()
    assert (w.w2_scale > 0).all()


def test_weights_are_cached_per_layout_and_device():
    assert expert_weights(TINY, "cpu") is expert_weights(TINY, "cpu")
    assert expert_weights(TINY, "cpu") is not expert_weights(dataclasses.replace(TINY, experts=11), "cpu")


def test_layout_rejects_shapes_that_are_not_one_gated_mlp():
    with pytest.raises(ShapeError, match="not one gated MLP"):
        ExpertLayout(4, GemmShape(64, 32), GemmShape(32, 16), 16)
    with pytest.raises(ShapeError, match="group size 24"):
        ExpertLayout(4, GemmShape(64, 48), GemmShape(48, 32), 24)


