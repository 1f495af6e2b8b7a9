"""Speculative decoding on a started server: the method, and what its counters say over a run.

:class:`SpecDecoding` is what ``--spec METHOD:K[:DRAFT]`` names (``ngram:4``, ``mtp:1``,
``eagle3:3:/path/to/draft``) and the ``--speculative-config`` JSON vLLM takes for it.
:class:`SpecCounters` reads vLLM's speculative-decoding counters (:data:`COUNTERS`, from
``vllm/v1/spec_decode/metrics.py``, the same names in 0.26 and 0.32) from ``/metrics`` before and
after a run, and derives vLLM's acceptance rate and mean acceptance length, the acceptance per
position, and the mean tokens a request gets per step over every step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from .metrics import labelled_samples

__all__ = ["COUNTERS", "SpecCounters", "SpecDecoding", "SpecMethod", "expected_tokens", "parse_spec",
           "per_position_acceptance", "spec_info"]

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
COUNTERS = (DRAFTS, DRAFT_TOKENS, ACCEPTED, PER_POSITION)
# ngram's n-gram window: the longest and shortest suffix of the context it looks up (vLLM's names)
NGRAM_LOOKUP_MAX, NGRAM_LOOKUP_MIN = 4, 2


class SpecMethod(str, Enum):
    """vLLM's ``speculative_config.method`` values the suite knows how to start and to predict."""

    NGRAM = "ngram"  # prompt lookup on the host: no draft weights; vLLM turns async scheduling off
    NGRAM_GPU = "ngram_gpu"  # the same lookup as GPU tensor ops; async scheduling stays on (vLLM 0.26+)
    MTP = "mtp"  # the model's own next-token-prediction layers (num_nextn_predict_layers > 0)
    EAGLE = "eagle"  # a separate EAGLE draft model
    EAGLE3 = "eagle3"

    @property
    def needs_draft_model(self) -> bool:
        return self in (SpecMethod.EAGLE, SpecMethod.EAGLE3)

    @property
    def prompt_lookup(self) -> bool:
        """Drafts by looking the context's last n-gram up in the context itself (no draft weights)."""
        return self in (SpecMethod.NGRAM, SpecMethod.NGRAM_GPU)


@dataclass(frozen=True)
class SpecDecoding:
    """K draft tokens per step by ``method`` (and a draft model for EAGLE).

    >>> spec = parse_spec("ngram:4")
    >>> spec.id, spec.verify_tokens
    ('ngram4', 5)
    >>> json.loads(spec.vllm_config())["prompt_lookup_max"]
    4
    """

    method: SpecMethod
    tokens: int  # K, num_speculative_tokens
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"{self.method.value}:{self.tokens}: K, the draft tokens per step, must be at least 1")
        if self.method.needs_draft_model and not self.draft_model:
            raise ValueError(f"{self.method.value}:{self.tokens}: {self.method.value} needs a draft model: "
                             f"{self.method.value}:{self.tokens}:PATH")
        if self.draft_model and not self.method.needs_draft_model:
            raise ValueError(f"{self.method.value} takes no draft model (got {self.draft_model!r})")

    @property
    def id(self) -> str:
        """What result ids carry: method and K (``ngram4``, ``mtp1``)."""
        return f"{self.method.value}{self.tokens}"

    @property
    def verify_tokens(self) -> int:
        """Tokens per request in a verification step: the K drafts and the last accepted token."""
        return self.tokens + 1

    def vllm_config(self) -> str:
        """The ``--speculative-config`` JSON for vLLM."""
        config: dict[str, object] = {"method": self.method.value, "num_speculative_tokens": self.tokens}
        if self.method.prompt_lookup:
            config.update(prompt_lookup_max=NGRAM_LOOKUP_MAX, prompt_lookup_min=NGRAM_LOOKUP_MIN)
        if self.draft_model:
            config["model"] = self.draft_model
        return json.dumps(config, separators=(",", ":"))

    def check_model(self, model_config: Mapping) -> None:
        """MTP needs next-token-prediction layers in the served config; ValueError naming the field.

        >>> parse_spec("mtp:1").check_model({"text_config": {"num_nextn_predict_layers": 0}})
        Traceback (most recent call last):
        ...
        ValueError: --spec mtp:1: the model has num_nextn_predict_layers = 0 (no MTP layers); use ngram or eagle
        """
        if self.method is not SpecMethod.MTP or not model_config:
            return
        text = model_config.get("text_config")
        layers = (text if isinstance(text, dict) else model_config).get("num_nextn_predict_layers", 0) or 0
        if layers < 1:
            raise ValueError(f"--spec {self.method.value}:{self.tokens}: the model has num_nextn_predict_layers = "
                             f"{layers} (no MTP layers); use ngram or eagle")


def parse_spec(text: str) -> SpecDecoding:
    """``METHOD:K[:DRAFT_MODEL]`` -> :class:`SpecDecoding`; ValueError naming what is wrong.

    >>> parse_spec("eagle3:3:/models/draft").draft_model
    '/models/draft'
    >>> parse_spec("medusa:2")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: --spec medusa:2: unknown method 'medusa'; choose one of ngram, ngram_gpu, mtp, eagle, eagle3
    """
    method, _, rest = text.strip().partition(":")
    tokens, _, draft = rest.partition(":")
    known = ", ".join(m.value for m in SpecMethod)
    if method not in {m.value for m in SpecMethod}:
        raise ValueError(f"--spec {text}: unknown method {method!r}; choose one of {known}")
    if not tokens.isdigit():
        raise ValueError(f"--spec {text}: K must be a whole number of draft tokens (METHOD:K, e.g. ngram:4)")
    return SpecDecoding(SpecMethod(method), int(tokens), draft or None)


# --- the counters over a run -------------------------------------------------------------------


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's speculative-decoding counters grown over one run, and the decode tokens it produced.

    >>> c = SpecCounters(drafts=10, draft_tokens=40, accepted=20, per_position=(8, 6, 4, 2), decode_tokens=30)
    >>> c.acceptance_rate, c.mean_acceptance_length, c.per_position_rate
    (0.5, 3.0, (0.8, 0.6, 0.4, 0.2))
    >>> c.request_steps, c.tokens_per_step, c.drafted_share
    (10, 3.0, 1.0)
    """

    drafts: int
    draft_tokens: int
    accepted: int
    per_position: tuple[int, ...] = ()
    decode_tokens: int | None = None  # tokens after each request's first: each one came from a decode step

    @classmethod
    def between(cls, before: str, after: str, decode_tokens: int | None = None) -> SpecCounters | None:
        """The counters' growth from the ``/metrics`` text ``before`` to ``after``; None when the
        server exports none of them (speculative decoding off, or no such metrics)."""
        b, a = _spec_samples(before), _spec_samples(after)
        if not a:
            return None
        grown = {key: a[key] - b.get(key, 0.0) for key in a}
        positions = sorted(int(pos) for name, pos in grown if name == PER_POSITION and pos.isdigit())
        per_pos = tuple(int(grown[(PER_POSITION, str(p))]) for p in positions)
        return cls(int(grown.get((DRAFTS, ""), 0)), int(grown.get((DRAFT_TOKENS, ""), 0)),
                   int(grown.get((ACCEPTED, ""), 0)), per_pos, decode_tokens)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed draft tokens (vLLM's 'draft acceptance rate')."""
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per drafted request-step, the bonus token included (vLLM's convention)."""
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def per_position_rate(self) -> tuple[float, ...]:
        """Per draft position i: the share of drafted steps whose first i + 1 drafts were accepted."""
        return tuple(n / self.drafts for n in self.per_position) if self.drafts else ()

    @property
    def request_steps(self) -> int | None:
        """Decode steps summed over requests: each gives one token plus the drafts it accepted."""
        if self.decode_tokens is None:
            return None
        return self.decode_tokens - self.accepted

    @property
    def tokens_per_step(self) -> float | None:
        """Mean tokens a request gets per decode step, steps without a draft included."""
        steps = self.request_steps
        return self.decode_tokens / steps if steps else None

    @property
    def drafted_share(self) -> float | None:
        """The share of request-steps that carried drafts (ngram finds no match on some)."""
        steps = self.request_steps
        return min(1.0, self.drafts / steps) if steps else None

    @property
    def draft_tokens_per_step(self) -> float | None:
        """Mean draft tokens a request carries per decode step (K on a step with a draft, else 0)."""
        steps = self.request_steps
        return self.draft_tokens / steps if steps else None

    def per_position_acceptance(self) -> float | None:
        """The i.i.d. per-position acceptance ``a`` whose expected tokens per drafted step
        (:func:`expected_tokens`) equal the measured mean acceptance length."""
        k = len(self.per_position) or (self.draft_tokens // self.drafts if self.drafts else 0)
        length = self.mean_acceptance_length
        return None if length is None or k < 1 else per_position_acceptance(length, k)

    def to_info(self) -> dict[str, object]:
        """The ``extra_info["spec_decode"]`` record."""
        a = self.per_position_acceptance()
        return {"num_drafts": self.drafts, "num_draft_tokens": self.draft_tokens,
                "num_accepted_tokens": self.accepted, "num_accepted_tokens_per_pos": list(self.per_position),
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length,
                "per_position_rate": list(self.per_position_rate), "decode_tokens": self.decode_tokens,
                "request_steps": self.request_steps, "tokens_per_step": self.tokens_per_step,
                "drafted_share": self.drafted_share, "draft_tokens_per_step": self.draft_tokens_per_step,
                "iid_acceptance": a}


def spec_info(spec: SpecDecoding | None, metrics_text: tuple[str, str], output_tokens: list[int]) -> dict:
    """``extra_info["spec_decode"]`` of one run: the method and K, and the counters over the run
    (``metrics_text``: ``/metrics`` before and after; ``output_tokens``: per completed request); {}
    when the server decodes without speculation and exports no counters.

    >>> after = 'vllm:spec_decode_num_drafts_total 4\\nvllm:spec_decode_num_accepted_tokens_total 6\\n'
    >>> info = spec_info(parse_spec("ngram:2"), ("", after), [11])
    >>> info["method"], info["k"], info["mean_acceptance_length"], info["tokens_per_step"]
    ('ngram', 2, 2.5, 2.5)
    """
    counters = SpecCounters.between(*metrics_text, decode_tokens=sum(max(0, n - 1) for n in output_tokens))
    if counters is None and spec is None:
        return {}
    info: dict[str, object] = {"method": spec.method.value if spec else None, "k": spec.tokens if spec else None}
    if counters is None:
        info["counters_error"] = "the server exports no vllm:spec_decode_* counters"
        return info
    return {**info, **counters.to_info()}


def _spec_samples(text: str) -> dict[tuple[str, str], float]:
    """(counter, position label or '') -> value summed over the other labels (engines, models)."""
    out: dict[tuple[str, str], float] = {}
    for name, labels, value in labelled_samples(text):
        if name in COUNTERS:
            key = (name, labels.get("position", "") if name == PER_POSITION else "")
            out[key] = out.get(key, 0.0) + value
    return out


# --- the acceptance model ---------------------------------------------------------------------


def expected_tokens(acceptance: float, k: int) -> float:
    """Expected tokens per verification step with K drafts, each accepted with probability
    ``acceptance`` given that every draft before it was (i.i.d.): ``sum_{i=0..K} a**i``.

    >>> expected_tokens(0.6, 4)
    2.3056
    >>> expected_tokens(0.0, 4), expected_tokens(1.0, 4)
    (1.0, 5.0)
    """
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance {acceptance!r} must lie in [0, 1]")
    return round(sum(acceptance**i for i in range(k + 1)), 12)


def per_position_acceptance(tokens_per_step: float, k: int) -> float:
    """The per-position acceptance ``a`` at which :func:`expected_tokens` gives ``tokens_per_step``
    (bisection; the sum grows with ``a``); clamped to [0, 1].

    >>> round(per_position_acceptance(2.3056, 4), 4)
    0.6
    """
    if tokens_per_step <= 1:
        return 0.0
    if tokens_per_step >= k + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens(mid, k) < tokens_per_step else (low, mid)
    return (low + high) / 2
