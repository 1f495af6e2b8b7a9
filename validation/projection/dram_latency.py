"""The latency of one dependent load per window size, on one GPU: a pointer chase through a random cycle of
128-byte lines, one thread, L1 bypassed. It tests whether the MoE's SM-side time (``sm_count.py``) is
memory latency rather than SM work: if so, it moves between GPUs with their DRAM latency, not with their
SMs and clock.

    python validation/projection/dram_latency.py --out DIR [--windows-mb 8,32,128,512,2048] [--hops 20000]

(on a CUDA machine with Triton.) Each window's chain is one cycle through all its lines in a random order
(:func:`make_chain`), so no line is read twice before all are, and the hardware cannot predict the next.
Windows under the L2 size time L2; windows many times over it, DRAM (plus the address translation a
random walk over that many pages costs, the same way on every GPU). Each window is timed with CUDA events
around one launch of ``--hops`` loads, after a launch that warms it; written: ``DIR/dram-latency.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

LINE = 128  # bytes: one L2 line; the chain holds one int64 per line
WORDS_PER_LINE = LINE // 8


def make_chain(lines: int, seed: int, device="cpu"):
    """An int64 buffer of ``lines`` lines whose first word of each line holds the word index of the next line
    in one random cycle through every line (the other words are 0)."""
    import torch
    if lines < 2:
        raise ValueError(f"a chain needs 2 or more lines, not {lines}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    order = torch.randperm(lines, generator=gen).to(device)
    buf = torch.zeros(lines * WORDS_PER_LINE, dtype=torch.int64, device=device)
    buf[order * WORDS_PER_LINE] = torch.roll(order, -1) * WORDS_PER_LINE
    return buf


def measure(windows_mb: list[int], hops: int, out: Path) -> dict:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def chase(buf, out_ptr, hops):
        idx = tl.load(buf)  # the word after word 0: an int64 from the start, as the loop carries it
        for _ in range(hops):
            idx = tl.load(buf + idx, cache_modifier=".cg")
        tl.store(out_ptr, idx)

    props = torch.cuda.get_device_properties(0)
    result = {"gpu": props.name, "l2_bytes": props.L2_cache_size, "hops": hops, "ns_per_load": {}}
    end_word = torch.zeros(1, dtype=torch.int64, device="cuda")
    for mb in windows_mb:
        buf = make_chain(mb * 2**20 // LINE, seed=mb, device="cuda")
        chase[(1,)](buf, end_word, min(hops, 2000), num_warps=1)  # compile, and warm the translations
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        chase[(1,)](buf, end_word, hops, num_warps=1)
        end.record()
        end.synchronize()
        result["ns_per_load"][str(mb)] = start.elapsed_time(end) * 1e6 / hops
        print(f"{props.name}: {mb} MiB window, {result['ns_per_load'][str(mb)]:.1f} ns per load", flush=True)
        del buf
        (out / "dram-latency.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for dram-latency.json")
    ap.add_argument("--windows-mb", default="8,32,128,512,2048", help="window sizes in MiB")
    ap.add_argument("--hops", type=int, default=20000, help="dependent loads timed per window")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    measure([int(w) for w in args.windows_mb.split(",")], args.hops, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
