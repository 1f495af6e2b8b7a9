"""Which experts the tokens of one MoE call go to: the distributions the MoE benchmark draws
from, shared with the server's routing simulator, and the routing profile a live server
captured.

A call of ``tokens`` tokens reads every expert any of them is routed to, so the number of
distinct experts, not the token count, sets most of its bytes. :func:`draw_experts` is the one
definition of the distributions (:class:`RoutingDistribution`): the MoE benchmark draws its
fixed assignment pattern with it, and the server's strategies
(:mod:`decodebench.serving.vllm_plugin`) every routing call, so both route alike by construction.
A routing profile's file format and what its replay leaves out: docs/attribution.md ("The routing
a real model runs").
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from .files import read_json, write_atomic

__all__ = ["PROFILE_FORMAT", "ROUTING_PROFILE_ENV", "LayerRouting", "RoutingDistribution", "RoutingProfile",
           "RoutingProfileError", "SlotPool", "distinct_draws", "draw_experts", "expected_distinct",
           "load_routing_profile", "profile_from_captures", "profile_from_env", "skew_split", "slot_pools",
           "summary_of", "write_routing_profile"]

PROFILE_FORMAT = "decodebench-routing-profile/1"
# --routing-profile FILE puts the file here, so the MoE case factory finds it in this process and
# in every worker process the session starts (fresh re-measures, A/B workers rebuild the cases).
ROUTING_PROFILE_ENV = "DECODEBENCH_ROUTING_PROFILE"
# Skewed routing: a hot set of 2 * top_k experts takes 3/4 of each token's slots.
_HOT_EXPERTS_PER_SLOT = 2
_HOT_SLOT_SHARE = 0.75


class RoutingDistribution(str, Enum):
    UNIFORM = "uniform"  # each token: top_k distinct experts, uniformly at random
    SKEWED = "skewed"  # a few hot experts take most slots: fewer distinct experts read
    PROFILE = "profile"  # the frequencies one layer of a served model routed to


class RoutingProfileError(ValueError):
    """A routing profile that cannot be read, or does not fit the model it is replayed on."""


def skew_split(top_k: int, experts: int) -> tuple[int, int]:
    """(hot experts, slots per token that go to them) of the skewed distribution.

    >>> skew_split(8, 384)
    (16, 6)
    """
    hot, hot_slots = _HOT_EXPERTS_PER_SLOT * top_k, round(_HOT_SLOT_SHARE * top_k)
    if experts - hot < top_k - hot_slots:
        from .errors import ShapeError

        raise ShapeError(f"skewed routing needs at least {hot + top_k - hot_slots} experts "
                         f"for top_k = {top_k}, the layout has {experts}")
    return hot, hot_slots


@dataclass(frozen=True)
class SlotPool:
    """Each token draws ``draws`` distinct experts uniformly from experts ``first .. first + count - 1``."""

    first: int
    count: int
    draws: int

    def chance(self) -> float:
        """The chance that one token takes a given expert of the pool."""
        return self.draws / self.count


def slot_pools(distribution: RoutingDistribution | str, experts: int, top_k: int) -> tuple[SlotPool, ...]:
    """The synthetic distributions as pools of uniform draws without replacement (what
    :func:`draw_experts` draws); a replayed profile has none (its weights say it).

    >>> slot_pools("skewed", 384, 8)
    (SlotPool(first=0, count=16, draws=6), SlotPool(first=16, count=368, draws=2))
    """
    kind = RoutingDistribution(distribution)
    if kind is RoutingDistribution.UNIFORM:
        return (SlotPool(0, experts, top_k),)
    if kind is RoutingDistribution.SKEWED:
        hot, hot_slots = skew_split(top_k, experts)
        return SlotPool(0, hot, hot_slots), SlotPool(hot, experts - hot, top_k - hot_slots)
    raise ValueError("profile routing has no pools: its captured frequencies weigh each expert")


def distinct_draws(rows: int, population: int, count: int, generator=None, device=None):
    """``count`` distinct values of ``range(population)`` per row, uniformly at random (int64)."""
    import torch

    # generator only when given: torch.rand(..., generator=None) takes no symbolic sizes, and
    # torch.compile traces the server's skewed strategy with a symbolic token count
    seeded = {"generator": generator} if generator is not None else {}
    return torch.rand(rows, population, device=device, **seeded).argsort(dim=1)[:, :count]


def draw_experts(tokens: int, experts: int, top_k: int, distribution: RoutingDistribution | str, *,
                 weights=None, generator=None, device=None):
    """Expert ids ``[tokens, top_k]`` (int64), distinct per token, drawn from ``distribution``.

    Skewed: experts ``0 .. 2*top_k - 1`` are hot and take 3/4 of every token's slots.
    Profile: ``weights`` (one per expert, the captured frequencies) weigh a draw without
    replacement. Only torch ops on ``device``, so a CUDA graph can hold them.

    >>> import torch
    >>> ids = draw_experts(4, 384, 8, "skewed", generator=torch.Generator().manual_seed(0))
    >>> ids.shape, bool((ids[:, :6] < 16).all()), bool((ids[:, 6:] >= 16).all())
    (torch.Size([4, 8]), True, True)
    """
    import torch

    kind = RoutingDistribution(distribution)
    if kind is RoutingDistribution.UNIFORM:
        return distinct_draws(tokens, experts, top_k, generator, device)
    if kind is RoutingDistribution.SKEWED:
        hot, hot_slots = skew_split(top_k, experts)
        cold = hot + distinct_draws(tokens, experts - hot, top_k - hot_slots, generator, device)
        return torch.cat([distinct_draws(tokens, hot, hot_slots, generator, device), cold], dim=1)
    if weights is None:
        raise ValueError("profile routing draws from captured frequencies: pass weights")
    weights = torch.as_tensor(weights, dtype=torch.float64, device=device)
    return torch.multinomial(weights.expand(tokens, experts), top_k, replacement=False, generator=generator)


def expected_distinct(weights: Sequence[float], tokens: int, top_k: int) -> float:
    """Distinct experts a call of ``tokens`` tokens reads on average when each slot falls on expert
    *e* with probability ``top_k * w_e`` per token (``w`` normalised), capped at 1: ``sum 1 - (1 - p_e)^tokens``.

    >>> round(expected_distinct([1.0] * 384, tokens=64, top_k=8), 1)
    284.2
    """
    total = sum(weights)
    return sum(1 - (1 - min(1.0, top_k * w / total)) ** tokens for w in weights if w > 0)


@dataclass(frozen=True)
class LayerRouting:
    """How one MoE layer routed: slots per expert over the captured steps (``counts``) and the tokens routed."""

    layer: int  # decoder layer index (the first MoE layer is first_k_dense_replace)
    counts: tuple[int, ...]
    tokens: int

    @property
    def weights(self) -> tuple[float, ...]:
        total = sum(self.counts)
        return tuple(c / total for c in self.counts)

    @property
    def experts_seen(self) -> int:
        return sum(1 for c in self.counts if c)

    def summary(self, top_k: int, batch: int | None = None) -> dict:
        """What a reader wants of a layer: experts seen, the hottest experts' share, the distinct
        experts one call of ``batch`` tokens reads under replay (and under uniform routing)."""
        ranked = sorted(self.counts, reverse=True)
        hot = 2 * top_k
        info = {"layer": self.layer, "tokens": self.tokens, "experts_seen": self.experts_seen,
                f"top{hot}_share": sum(ranked[:hot]) / max(1, sum(ranked))}
        if batch:
            info["replay_distinct_at_batch"] = expected_distinct(self.counts, batch, top_k)
            info["uniform_distinct_at_batch"] = expected_distinct([1] * len(self.counts), batch, top_k)
        return info


@dataclass(frozen=True)
class RoutingProfile:
    """The routing of a served model's MoE layers, as captured over profiled decode steps."""

    model: str
    experts: int
    top_k: int
    layers: tuple[LayerRouting, ...]
    source: str = ""

    def check_fits(self, experts: int, top_k: int, model: str, where: str) -> None:
        """Raise :class:`RoutingProfileError` when the profile was captured with other experts or top-k.

        >>> p = RoutingProfile("tiny-kimi", 16, 4, ())
        >>> p.check_fits(384, 8, "kimi-k2.5", "p.json")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        decodebench.moe_routing.RoutingProfileError: p.json: captured with 16 experts, top-4 (tiny-kimi); ...
        """
        if (self.experts, self.top_k) != (experts, top_k):
            raise RoutingProfileError(f"{where}: captured with {self.experts} experts, top-{self.top_k} "
                                      f"({self.model}); {model} has {experts} experts, top-{top_k}")

    def to_json(self) -> dict:
        return {"format": PROFILE_FORMAT, "model": self.model, "experts": self.experts, "top_k": self.top_k,
                "source": self.source,
                "layers": [{"layer": r.layer, "tokens": r.tokens, "counts": list(r.counts)} for r in self.layers]}


def write_routing_profile(path: Path, profile: RoutingProfile) -> Path:
    """Write ``profile`` to ``path`` (whole or not at all)."""
    write_atomic(Path(path), (json.dumps(profile.to_json(), indent=1) + "\n").encode())
    return Path(path)


def load_routing_profile(path: Path | str) -> RoutingProfile:
    """Read a routing profile; raises :class:`RoutingProfileError` naming the file and what is wrong."""
    path = Path(path)
    try:
        data = read_json(path)
    except ValueError as exc:
        raise RoutingProfileError(f"{path}: not a readable routing profile ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise RoutingProfileError(f"{path}: not a decodebench routing profile (format {found!r}, "
                                  f"expected {PROFILE_FORMAT!r})")
    experts, top_k = data.get("experts"), data.get("top_k")
    if not (_positive_int(experts) and _positive_int(top_k) and top_k <= experts):
        raise RoutingProfileError(f"{path}: experts {experts!r} and top_k {top_k!r} must be integers, "
                                  "1 <= top_k <= experts")
    layers = tuple(_layer(path, entry, experts, top_k) for entry in data.get("layers") or [])
    if not layers:
        raise RoutingProfileError(f"{path}: no layers in the profile")
    if len({r.layer for r in layers}) != len(layers):
        raise RoutingProfileError(f"{path}: a layer appears twice")
    return RoutingProfile(str(data.get("model", "?")), experts, top_k, layers, str(data.get("source", "")))


def profile_from_env() -> tuple[RoutingProfile, str] | None:
    """The routing profile ``--routing-profile`` named for this session (and its path), or None."""
    import os

    path = os.environ.get(ROUTING_PROFILE_ENV)
    return (_cached_profile(path), path) if path else None


@functools.lru_cache(maxsize=4)
def _cached_profile(path: str) -> RoutingProfile:
    return load_routing_profile(path)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _layer(path: Path, entry, experts: int, top_k: int) -> LayerRouting:
    if not isinstance(entry, dict):
        raise RoutingProfileError(f"{path}: a layer entry is {type(entry).__name__}, not an object")
    layer, counts, tokens = entry.get("layer"), entry.get("counts"), entry.get("tokens")
    where = f"{path}: layer {layer!r}"
    if not isinstance(layer, int) or layer < 0:
        raise RoutingProfileError(f"{where}: the layer index must be an integer >= 0")
    if not isinstance(counts, list) or len(counts) != experts:
        size = len(counts) if isinstance(counts, list) else type(counts).__name__
        raise RoutingProfileError(f"{where}: counts has {size} entries, the profile has {experts} experts")
    if not all(_positive_int(c) or c == 0 for c in counts) or sum(counts) == 0:
        raise RoutingProfileError(f"{where}: counts must be integers >= 0, not all 0")
    if sum(1 for c in counts if c) < top_k:
        raise RoutingProfileError(f"{where}: only {sum(1 for c in counts if c)} experts ever routed to, "
                                  f"fewer than top_k = {top_k}: no token could draw {top_k} distinct ones")
    if not _positive_int(tokens) or sum(counts) != tokens * top_k:
        raise RoutingProfileError(f"{where}: {sum(counts)} slots is not tokens ({tokens!r}) x top_k ({top_k})")
    return LayerRouting(layer, tuple(counts), tokens)


def profile_from_captures(captures: Iterable[dict], model: str, first_moe_layer: int, source: str = "") \
        -> RoutingProfile:
    """The routing profile of one window from the server plugin's capture dumps (one per rank; ranks of a
    TP group route alike, so the first rank's is taken). Router *i* of the dump is MoE layer
    ``first_moe_layer + i`` (routers are built in layer order).
    """
    dumps = sorted(captures, key=lambda d: d.get("rank", 0))
    if not dumps:
        raise RoutingProfileError("no routing capture was written in the window")
    routers = dumps[0].get("routers") or []
    if not routers:
        raise RoutingProfileError(f"the routing capture of rank {dumps[0].get('rank')} holds no MoE router")
    experts, top_k = routers[0]["experts"], routers[0]["top_k"]
    layers = []
    for i, router in enumerate(routers):
        counts = [int(round(c)) for c in router["counts"]]
        layers.append(LayerRouting(first_moe_layer + i, tuple(counts), sum(counts) // top_k if top_k else 0))
    return RoutingProfile(model, experts, top_k, tuple(layers), source)


def summary_of(profile: RoutingProfile, batch: int | None) -> dict:
    """Per layer what :meth:`LayerRouting.summary` says, and the mean over layers."""
    layers = [r.summary(profile.top_k, batch) for r in profile.layers]
    out = {"model": profile.model, "experts": profile.experts, "top_k": profile.top_k, "layers": layers}
    if batch and layers:
        out["mean_replay_distinct_at_batch"] = math.fsum(x["replay_distinct_at_batch"] for x in layers) / len(layers)
    return out
