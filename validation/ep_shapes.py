"""Kimi-K2.5 at EP 8: the per-rank shapes, the expected and benchmarked loads of the busiest rank,
the dispatch message sizes and the bytes one MoE call reads under TP 8 and EP 8 (arithmetic from
DecodeShapes and the cases, no measurement). Writes what validation/h200/ep/ep-shapes.txt holds:

    PYTHONPATH=. python validation/ep_shapes.py > validation/h200/ep/ep-shapes.txt
"""
from decodebench.attribution.depth import weight_bytes_per_rank
from decodebench.distributed.dispatch import dispatch_cases
from decodebench.kernels.moe import MoECase, moe_cases
from decodebench.kernels.moe_ep import ep_moe_cases
from decodebench.model import load_model_spec
from decodebench.shapes import DecodeShapes, sweep_for

s = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8, ep=8)
e = s.expert_parallel
print(f"kimi-k2.5 EP {e.ep}: {e.local_experts} local experts, gate_up {e.gate_up}, down {e.down}; "
      f"weights per rank {weight_bytes_per_rank(s.spec, 8) / 2**30:.1f} GiB (TP 8: the same)")
print("expected per rank (DecodeShapes.expert_parallel, linear placement): busiest rank / mean rank")
print(f"{'routing':<8} {'M':>4} {'rank':>4} {'tokens':>7} {'slots':>8} {'experts':>8} {'mean slots':>10} "
      f"{'imbalance':>9}")
for routing in ("uniform", "skewed"):
    for m in (1, 64, 256):
        b = e.busiest(routing, m)
        print(f"{routing:<8} {m:>4} {b.rank:>4} {b.tokens:>7.2f} {b.slots:>8.2f} {b.experts:>8.2f} "
              f"{m * e.top_k / e.ep:>10.2f} {e.imbalance(routing, m):>9.2f}")
print("the benchmark's cases (fixed routing pattern, the busiest rank timed)")
for c in ep_moe_cases(s, sweep_for("nightly")):
    if c.tokens in (1, 64, 256):
        print(f"  {c.id}: rank {c.rank}, {c.rank_tokens} tokens, {c.rank_slots} slots, "
              f"{c.distinct_experts} experts, imbalance {c.shape()['rank_imbalance']:.2f}")
print("dispatch/combine message sizes (per rank pair for all-to-all, per rank for all-gather/reduce-scatter)")
for c in dispatch_cases(s, sweep_for("nightly")):
    if c.tokens in (1, 64, 256):
        print(f"  {c.id}: {c.chunk_bytes} B")
tp = {(c.tokens, c.routing): c for c in moe_cases(DecodeShapes.for_deployment(s.spec, 8), sweep_for("nightly"))
      if isinstance(c, MoECase) and c.stage.value == "fused" and c.profile is None}
print("bytes one MoE call reads on the rank the step waits for: TP 8 (every rank alike) vs EP 8 (the busiest rank),")
print("the same routing pattern (MoECase.traffic, EPMoECase.traffic; not a measurement)")
for c in ep_moe_cases(s, sweep_for("nightly")):
    if c.tokens in (1, 64, 256):
        t = tp[(c.tokens, c.routing)]
        a, b = t.traffic().bytes_read, c.traffic().bytes_read
        print(f"  {c.routing.value:<8} M={c.tokens:<4} TP {a / 1e6:8.1f} MB ({t.distinct_experts} experts x 1/8)  "
              f"EP {b / 1e6:8.1f} MB ({c.distinct_experts} whole experts)  EP/TP {b / a:.2f}")
