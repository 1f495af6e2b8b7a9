"""Which kernels the server's uniform routing simulator launches, as a CUDA graph replays them.

The served step at --server-routing uniform routes through decodebench's vLLM plugin strategy
(decodebench.serving.vllm_plugin), which the decode step's full CUDA graph holds. This captures
that very strategy's route_tokens (vLLM's RoutingStrategy base, our draw) in a graph at C tokens,
replays it under torch.profiler and prints each kernel with its duration, so the profile's
kernels of the simulator can be named apart from the step's own.
Usage: python validation/tp8/simulator_kernels.py [C ...]   (on a GPU with vLLM importable)
"""

import sys

import torch

from decodebench.kernel_rules import classify
from decodebench.serving.vllm_plugin import _simulator, _strategy


def kernels_of_one_route(tokens: int, experts: int = 384, top_k: int = 8) -> list[tuple[str, float]]:
    strategy = _strategy(_simulator("uniform").RoutingStrategy, "uniform")
    logits = torch.randn(tokens, experts, device="cuda")
    hidden = torch.randn(tokens, 7168, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            strategy.route_tokens(hidden, logits, top_k, torch.int32)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        strategy.route_tokens(hidden, logits, top_k, torch.int32)
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [(e.name, e.device_time) for e in sorted(events, key=lambda e: e.time_range.start)]


def main(argv: list[str]) -> int:
    for tokens in [int(a) for a in argv] or [1, 64, 256]:
        print(f"C = {tokens}: the uniform simulator's route_tokens, replayed in a CUDA graph")
        for name, us in kernels_of_one_route(tokens):
            found = classify(name)
            print(f"  {us:7.2f} us  {found or 'unmatched':14s} {name[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
