"""A profiler window over decode steps of a live vLLM server, and the server flags it needs.

The server must run with ``--profiler-config`` (vLLM's torch profiler, traces into a
directory); ``POST /start_profile`` and ``/stop_profile`` then open and close a window.
:class:`DecodeWindow` is ``measure_decode``'s ``window``: armed before a round of its own is
sent, it lets the engine itself skip ``delay`` steps (the prefills, requests still being
admitted) and profile the next ``steps`` (``delay_iterations``, ``max_iterations``), so where
the window falls is counted in engine steps, not in what a client has read. Closed after the
round, it returns the new files (:class:`WindowFiles`): one trace per rank and, when the
server captures its routing (``--capture-routing``), one routing count per rank.
:func:`window_delay` puts the window in the middle of the round's decode.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ...errors import ServerError
from ...serving.handle import http_get
from ...serving.metrics import parse_prometheus
from .trace import trace_files

__all__ = ["DecodeWindow", "MIN_DELAY", "ProfileError", "WindowFiles", "config_override", "config_overrides",
           "profiler_config", "routing_files", "window_delay"]

ROUTING_CAPTURES = "routing-capture.rank*.json"  # what decodebench.serving.vllm_plugin writes
STEP_COUNT = "vllm:iteration_tokens_total_count"  # one observation per engine step (vllm/v1/metrics/loggers.py)


class ProfileError(RuntimeError):
    """The profiler window could not be opened or produced no trace (the message says why)."""


MIN_DELAY = 2  # engine steps: a round's first step is a prefill


def window_delay(output_len: int, steps: int, tokens_per_step: int = 1) -> int:
    """Engine steps from a round's start to its profiled window: the window sits in the middle of
    the fewest steps the round's decode can take (``output_len`` tokens at ``tokens_per_step``,
    1 + K under speculative decoding with K draft tokens), so every request of the round was
    admitted and none has finished, and the context is the round's mean.

    >>> window_delay(128, 8), window_delay(480, 8), window_delay(48, 8, tokens_per_step=4)
    (60, 236, 2)
    """
    return max(MIN_DELAY, (output_len // tokens_per_step - steps) // 2)


def profiler_config(trace_dir: Path, delay: int = 0, steps: int = 0) -> str:
    """The ``--profiler-config`` JSON: torch profiler, no Python stacks (overhead), gzip'd traces,
    a window of ``steps`` engine steps ``delay`` steps after ``/start_profile``
    (``max_iterations``, ``delay_iterations``: vLLM 0.26 takes them only here, 0.32 also in the
    request), and nothing the analysis does not read (fields of vLLM 0.26 and 0.32):

    * ``ignore_frontend``: no profiler in the API server. It ignores ``max_iterations`` and records
      the front end for the whole window; on a 2-core machine beside a CPU-bound process the API
      server then sent the first tokens of the next round's requests after the engine had decoded
      all 480 (client TTFT 2852 ms, the server's own 17 ms; with it off, 22 ms);
    * ``torch_profiler_dump_cuda_time_total`` off: the summary the analysis does not read (with it
      on, that neighbour delayed the first tokens further: docs/development.md).

    >>> config = json.loads(profiler_config(Path("/t"), delay=60, steps=8))
    >>> config["profiler"], config["ignore_frontend"], config["delay_iterations"], config["max_iterations"]
    ('torch', True, 60, 8)
    """
    return json.dumps({"profiler": "torch", "torch_profiler_dir": str(trace_dir), "ignore_frontend": True,
                       "torch_profiler_dump_cuda_time_total": False, "torch_profiler_with_stack": False,
                       "torch_profiler_use_gzip": True, "delay_iterations": delay, "max_iterations": steps})


def config_overrides(config: Mapping, fields: Mapping) -> dict:
    """``fields`` as ``--hf-overrides`` sets them in ``config`` (nested in ``text_config`` for Kimi-K2.5).

    >>> config_overrides({"text_config": {}}, {"vocab_size": 20480})
    {'text_config': {'vocab_size': 20480}}
    """
    inner = dict(fields)
    return {"text_config": inner} if isinstance(config.get("text_config"), dict) else inner


def config_override(config: Mapping, fields: Mapping) -> str:
    """The ``--hf-overrides`` JSON of :func:`config_overrides`.

    >>> config_override({"num_hidden_layers": 2}, {"num_hidden_layers": 1})
    '{"num_hidden_layers": 1}'
    """
    return json.dumps(config_overrides(config, fields))


def _post(url: str, body: dict, headers: Mapping[str, str], timeout_s: float) -> None:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        hint = " (is the server running with --profiler-config?)" if exc.code == 404 else ""
        raise ProfileError(f"POST {url}: HTTP {exc.code} {exc.reason}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ProfileError(f"POST {url}: {getattr(exc, 'reason', exc)!s}") from None


def routing_files(directory: Path) -> set[Path]:
    """The routing counts the server's plugin wrote into ``directory``."""
    return set(Path(directory).glob(ROUTING_CAPTURES))


@dataclass(frozen=True)
class WindowFiles:
    """What one window left in the trace directory: the rank traces and the routing counts, and how
    many engine steps into its round the window's last step was (``delay + steps``)."""

    traces: tuple[Path, ...]
    routing: tuple[Path, ...] = ()
    last_step: int = 0


class _Opened(NamedTuple):
    """What an open window compares against when closed: the files already there, and the server's
    step count at the open (None where ``/metrics`` does not count steps)."""

    traces: set[Path]
    routing: set[Path]
    steps_counted: float | None


@dataclass
class DecodeWindow:
    """Profile ``steps`` engine steps that start ``delay`` steps into a round; return the traces
    that appeared in ``trace_dir``.

    :meth:`open` asks ``/start_profile`` for the window, and the engine counts the steps;
    :meth:`close` waits for the server's step counter (at most ``step_wait_s``), then
    ``/stop_profile``, and awaits ``ranks`` traces (and with ``capture_routing`` as many routing
    counts) for up to ``write_timeout_s`` (docs/attribution.md, "Only decode steps, and how that is
    checked", steps 2 to 4). A round that ran out before the window began is said so, not awaited.

    Example::

        window = DecodeWindow(handle.base_url, Path("/tmp/vtrace"), ranks=1, delay=window_delay(128, 8))
        run = measure_decode(handle, load, window=window)
        files = run.window_result  # WindowFiles, or the ProfileError of a failed window
    """

    base_url: str
    trace_dir: Path
    ranks: int
    steps: int = 8
    delay: int = MIN_DELAY
    step_wait_s: float = 30.0
    write_timeout_s: float = 120.0
    request_timeout_s: float = 300.0  # a profiler start on a GPU (CUPTI) can take seconds
    short_round_wait_s: float = 5.0  # for traces after a round that ended before the window's delay
    headers: Mapping[str, str] = field(default_factory=dict)
    capture_routing: bool = False
    _opened: _Opened | ProfileError | None = field(default=None, init=False, repr=False)

    def open(self) -> None:
        """Arm the window before the round; a failure is kept for :meth:`close` to return."""
        traces, routing = trace_files(self.trace_dir), routing_files(self.trace_dir)
        try:
            self._post("/start_profile", {"delay_iterations": self.delay, "max_iterations": self.steps})
        except ProfileError as exc:
            self._opened = exc
            return
        self._opened = _Opened(traces, routing, self._steps_counted())

    def close(self) -> WindowFiles | ProfileError:
        """The window's rank traces (and routing counts); a window that failed returns its error (the
        decode run goes on, and the analysis reports it) instead of failing the TPOT measurement."""
        opened, self._opened = self._opened, None
        if opened is None:
            return ProfileError("the profiler window was closed without being opened")
        if isinstance(opened, ProfileError):
            return opened
        try:
            return self._collect(opened)
        except ProfileError as exc:
            return exc

    def _collect(self, opened: _Opened) -> WindowFiles:
        ran = self._await_steps(opened.steps_counted)
        self._post("/stop_profile", {})
        short = ran is not None and ran < self.delay  # no trace, unless the server ignored the delay
        try:
            traces = self._await_traces(opened.traces, self.short_round_wait_s if short else self.write_timeout_s)
        except ProfileError:
            if short:
                raise ProfileError(f"the profiled round ran {ran:.0f} engine steps, and the window began after "
                                   f"{self.delay}: no step was profiled (a longer --output-len gives it "
                                   "room)") from None
            raise
        routing = self._await_routing(opened.routing) if self.capture_routing else ()
        return WindowFiles(traces, routing, self.delay + self.steps)

    def _await_steps(self, opened: float | None) -> float | None:
        """Engine steps since the open, once ``delay + steps`` were counted or the counter stopped
        moving for a second (the round is over); None where ``/metrics`` does not count steps."""
        if opened is None:
            return None
        deadline, last, still_since = time.monotonic() + self.step_wait_s, opened, time.monotonic()
        while True:
            now = self._steps_counted()
            if now is None:
                return None
            if now - opened >= self.delay + self.steps or time.monotonic() >= deadline:
                return now - opened
            if now != last:
                last, still_since = now, time.monotonic()
            elif time.monotonic() - still_since >= 1.0:
                return now - opened
            time.sleep(0.1)

    def _post(self, path: str, body: dict) -> None:
        _post(self.base_url + path, body, self.headers, self.request_timeout_s)

    def _steps_counted(self) -> float | None:
        """The server's engine steps so far, or None where ``/metrics`` does not count them."""
        try:
            return parse_prometheus(http_get(self.base_url + "/metrics", 10.0, self.headers)).get(STEP_COUNT)
        except ServerError:
            return None

    def _await_traces(self, before: set[Path], timeout_s: float) -> tuple[Path, ...]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            new = sorted(trace_files(self.trace_dir) - before)
            if len(new) >= self.ranks and all(_settled(p) for p in new):
                return tuple(new)
            time.sleep(0.5)
        raise ProfileError(f"{self.trace_dir}: {len(trace_files(self.trace_dir) - before)} of {self.ranks} "
                           f"rank traces written within {timeout_s:.0f} s of /stop_profile")

    def _await_routing(self, before: set[Path]) -> tuple[Path, ...]:
        """The routing counts of the window (written whole by the plugin, by rename)."""
        deadline = time.monotonic() + self.write_timeout_s
        while time.monotonic() < deadline:
            new = sorted(routing_files(self.trace_dir) - before)
            if len(new) >= self.ranks:
                return tuple(new)
            time.sleep(0.2)
        raise ProfileError(f"{self.trace_dir}: {len(routing_files(self.trace_dir) - before)} of {self.ranks} "
                           "routing counts written by the server's plugin within "
                           f"{self.write_timeout_s:.0f} s of /stop_profile (--capture-routing)")


def _settled(path: Path) -> bool:
    """A trace file whose size no longer changes (the writer has finished)."""
    try:
        size = path.stat().st_size
        time.sleep(0.2)
        return size > 0 and path.stat().st_size == size
    except OSError:
        return False
