"""What a decode run asks of the server: C concurrent clients, fixed input and output lengths, prompts."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from ..shapes import SweepLevel

__all__ = ["CONCURRENCY", "DecodeLoad", "MIN_PROMPTS", "decode_loads", "prompt_token_ids"]

# Client concurrencies per sweep level.
CONCURRENCY: dict[SweepLevel, tuple[int, ...]] = {
    SweepLevel.SMOKE: (1, 4),
    SweepLevel.NIGHTLY: (1, 64, 256),
    SweepLevel.FULL: (1, 8, 16, 32, 64, 128, 256),
}
MIN_PROMPTS = 8  # TPOT samples per benchmark at C = 1, enough for a median and its interval


@dataclass(frozen=True)
class DecodeLoad:
    """One point of the e2e decode axis: C concurrent clients, fixed input and output lengths.

    ``num_prompts`` defaults to ``max(8, 2·C)``; a load of another count (``vllm bench serve
    --max-concurrency C --num-prompts N``: ``--concurrency C:N``) says so in its id. So do prompts
    made of one repeated span of ``repeat_span`` tokens (``--prompt-repeat``: the ngram proposer
    finds matches in them) and a server that decodes speculatively (``spec``, e.g. ``ngram4``).

    >>> DecodeLoad(concurrency=4, input_len=128, output_len=64).id
    'c4-in128-out64'
    >>> DecodeLoad(4, 128, 64).num_prompts
    8
    >>> DecodeLoad(64, 1024, 128, num_prompts=256).id
    'c64-in1024-out128-n256'
    >>> DecodeLoad(1, 1024, 128, repeat_span=64, spec="ngram4").id
    'c1-in1024-out128-rep64-ngram4'
    """

    concurrency: int
    input_len: int
    output_len: int
    num_prompts: int = 0  # 0: max(MIN_PROMPTS, 2 * concurrency)
    repeat_span: int = 0  # 0: random prompts; else each prompt repeats one random span of this many tokens
    spec: str = ""  # the server's speculative decoding (SpecDecoding.id), "" without

    def __post_init__(self) -> None:
        if min(self.concurrency, self.input_len) < 1 or self.output_len < 2 or self.num_prompts < 0:
            raise ValueError(f"{self}: needs concurrency >= 1, input_len >= 1, output_len >= 2 (TPOT) and "
                             "num_prompts >= 0")
        if not 0 <= self.repeat_span <= self.input_len:
            raise ValueError(f"{self}: repeat_span must lie in 0..input_len")
        if self.num_prompts == 0:
            object.__setattr__(self, "num_prompts", self.default_prompts)

    @property
    def default_prompts(self) -> int:
        return max(MIN_PROMPTS, 2 * self.concurrency)

    @property
    def id(self) -> str:
        prompts = f"-n{self.num_prompts}" if self.num_prompts != self.default_prompts else ""
        repeat = f"-rep{self.repeat_span}" if self.repeat_span else ""
        spec = f"-{self.spec}" if self.spec else ""
        return f"c{self.concurrency}-in{self.input_len}-out{self.output_len}{prompts}{repeat}{spec}"


def decode_loads(concurrencies: Sequence[int | tuple[int, int]], input_len: int, output_len: int, *,
                 repeat_span: int = 0, spec: str = "") -> list[DecodeLoad]:
    """The loads of one session, in the order given: a concurrency, or (concurrency, prompts).

    >>> [load.id for load in decode_loads((1, (4, 32)), 128, 64)]
    ['c1-in128-out64', 'c4-in128-out64-n32']
    """
    loads = []
    for c in concurrencies:
        concurrency, prompts = c if isinstance(c, tuple) else (c, 0)
        loads.append(DecodeLoad(concurrency, input_len, output_len, prompts, repeat_span, spec))
    return loads


def prompt_token_ids(count: int, length: int, vocab_size: int | None, seed: int = 0,
                     repeat_span: int = 0) -> list[list[int]]:
    """``count`` random prompts of ``length`` token ids, reproducible from ``seed``.

    With ``repeat_span``, each prompt is one random span of that many ids repeated up to
    ``length`` (each prompt its own span, so prefix caching still finds nothing to reuse): an
    n-gram of it recurs, which vLLM's ngram proposer looks up to draft tokens.

    Ids stay clear of both ends of the vocabulary, where special tokens live. With the
    vocabulary unknown (a remote server's config is not on this machine) they are drawn
    from 100..999, ordinary tokens in any vocabulary of 1024 or more.

    >>> prompts = prompt_token_ids(2, 3, vocab_size=1024)
    >>> [len(p) for p in prompts], all(128 <= t < 896 for p in prompts for t in p)
    ([3, 3], True)
    >>> prompt = prompt_token_ids(1, 7, vocab_size=1024, repeat_span=3)[0]
    >>> prompt[:3] == prompt[3:6] == prompt[6:] + prompt[1:3]
    True
    """
    margin = min(1000, vocab_size // 8) if vocab_size else 0
    low, high = (margin, vocab_size - margin) if vocab_size else (100, 1000)
    rng = random.Random(seed)
    if not repeat_span:
        return [[rng.randrange(low, high) for _ in range(length)] for _ in range(count)]
    spans = [[rng.randrange(low, high) for _ in range(repeat_span)] for _ in range(count)]
    return [(span * -(-length // repeat_span))[:length] for span in spans]
