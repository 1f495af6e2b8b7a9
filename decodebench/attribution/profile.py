"""A profiler window over decode steps of a live vLLM server, and the server flags it needs.

The server must run with ``--profiler-config`` (vLLM's torch profiler, traces into a
directory); ``POST /start_profile`` and ``/stop_profile`` then open and close a window.
:class:`DecodeWindow` is meant as ``measure_decode``'s ``during_decode`` hook: called once
every request of the load has its first token (no prefill is left and no request has
finished), it profiles at most ``steps`` model steps (``max_iterations``) and returns the
new files (:class:`WindowFiles`): one trace per rank and, when the server captures its
routing (``--capture-routing``), one routing count per rank.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..serving.metrics import parse_prometheus
from .trace import trace_files

__all__ = ["DecodeWindow", "ProfileError", "WindowFiles", "layer_override", "profiler_config", "routing_files"]

ROUTING_CAPTURES = "routing-capture.rank*.json"  # what decodebench.serving.vllm_plugin writes
STEP_COUNT = "vllm:iteration_tokens_total_count"  # one observation per engine step (vllm/v1/metrics/loggers.py)


class ProfileError(RuntimeError):
    """The profiler window could not be opened or produced no trace (the message says why)."""


def profiler_config(trace_dir: Path) -> str:
    """The ``--profiler-config`` JSON: torch profiler, no Python stacks (overhead), gzip'd traces,
    and nothing the analysis does not read (fields of vLLM 0.26 and 0.32):

    * ``ignore_frontend``: no profiler in the API server. It ignores ``max_iterations`` and records
      the front end for the whole window; on a 2-core machine beside a CPU-bound process the API
      server then sent the first tokens of the next round's requests after the engine had decoded
      all 480 (client TTFT 2852 ms, the server's own 17 ms; with it off, 22 ms);
    * ``torch_profiler_dump_cuda_time_total`` off: the summary the analysis does not read. With
      ``ignore_frontend`` alone the live breakdown test beside that neighbour still failed (the
      profiled round's first tokens 3.97 s in, as its decode ended); with this off too it passed
      in 2 of 2 runs (first tokens 0.14-0.28 s in). Why is not established: the worker still writes
      its CPU table (``profiler_out.txt``), and on two pytest-xdist workers the test failed once
      more (docs/cpu/test-time/).

    >>> config = json.loads(profiler_config(Path("/t")))
    >>> config["profiler"], config["ignore_frontend"], config["torch_profiler_dump_cuda_time_total"]
    ('torch', True, False)
    """
    return json.dumps({"profiler": "torch", "torch_profiler_dir": str(trace_dir), "ignore_frontend": True,
                       "torch_profiler_dump_cuda_time_total": False, "torch_profiler_with_stack": False,
                       "torch_profiler_use_gzip": True})


def layer_override(config: Mapping, layers: int) -> str:
    """The ``--hf-overrides`` JSON serving ``layers`` decoder layers (nested in ``text_config`` for Kimi-K2.5).

    >>> layer_override({"text_config": {"num_hidden_layers": 61}}, 4)
    '{"text_config": {"num_hidden_layers": 4}}'
    >>> layer_override({"num_hidden_layers": 2}, 1)
    '{"num_hidden_layers": 1}'
    """
    inner = {"num_hidden_layers": layers}
    return json.dumps({"text_config": inner} if isinstance(config.get("text_config"), dict) else inner)


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
    """What one window left in the trace directory: the rank traces and the routing counts."""

    traces: tuple[Path, ...]
    routing: tuple[Path, ...] = ()


@dataclass(frozen=True)
class DecodeWindow:
    """Profile ``steps`` decode steps; return the traces that appeared in ``trace_dir``.

    The window stays open at least ``window_s``, and then until the server's own step counter
    (``/metrics``) has counted ``steps`` engine steps since ``/start_profile`` answered, for at
    most ``step_wait_s`` more: on a loaded machine the engine can run no step at all in
    ``window_s`` (seen on a 2-core runner beside another test process, a trace with no step).
    A server without that counter gets the fixed window. ``ranks`` traces (and with
    ``capture_routing`` as many routing counts) are awaited for up to ``write_timeout_s`` after
    the stop.

    Example::

        window = DecodeWindow(handle.base_url, Path("/tmp/vtrace"), ranks=1)
        run = measure_decode(handle, load, during_decode=window)
        files = run.during_decode_result  # WindowFiles, or the ProfileError of a failed window
    """

    base_url: str
    trace_dir: Path
    ranks: int
    steps: int = 8
    window_s: float = 1.0
    step_wait_s: float = 30.0
    write_timeout_s: float = 120.0
    request_timeout_s: float = 300.0  # the first window starts CUPTI, which takes seconds
    headers: Mapping[str, str] = field(default_factory=dict)
    capture_routing: bool = False

    def __call__(self) -> WindowFiles | ProfileError:
        """The new rank traces (and routing counts); a window that failed returns its error (the
        decode run goes on, and the analysis reports it) instead of failing the TPOT measurement."""
        try:
            return self._profile()
        except ProfileError as exc:
            return exc

    def _profile(self) -> WindowFiles:
        before, counted = trace_files(self.trace_dir), routing_files(self.trace_dir)
        self._post("/start_profile", {"max_iterations": self.steps})
        opened = self._steps_counted()
        time.sleep(self.window_s)
        if opened is not None:
            deadline = time.monotonic() + self.step_wait_s
            while time.monotonic() < deadline:
                now = self._steps_counted()
                if now is None or now - opened >= self.steps:
                    break
                time.sleep(0.1)
        self._post("/stop_profile", {})
        traces = self._await_traces(before)
        routing = self._await_routing(counted) if self.capture_routing else ()
        return WindowFiles(traces, routing)

    def warm_up(self, wait_s: float = 15.0) -> None:
        """One empty window, so that the profiler's start-up cost (seconds with CUPTI) is paid
        before a measured one; waits up to ``wait_s`` for its (stepless) traces."""
        before, counted = trace_files(self.trace_dir), routing_files(self.trace_dir)
        self._post("/start_profile", {"max_iterations": 1})
        self._post("/stop_profile", {})
        self._await_traces(before, timeout_s=wait_s)
        if self.capture_routing:
            self._await_routing(counted, timeout_s=wait_s)

    def _post(self, path: str, body: dict) -> None:
        _post(self.base_url + path, body, self.headers, self.request_timeout_s)

    def _steps_counted(self) -> float | None:
        """The server's engine steps so far, or None where ``/metrics`` does not count them."""
        request = urllib.request.Request(self.base_url + "/metrics", headers=dict(self.headers))
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return parse_prometheus(response.read().decode()).get(STEP_COUNT)
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def _await_traces(self, before: set[Path], timeout_s: float | None = None) -> tuple[Path, ...]:
        required = timeout_s is None
        deadline = time.monotonic() + (self.write_timeout_s if required else timeout_s)
        while time.monotonic() < deadline:
            new = sorted(trace_files(self.trace_dir) - before)
            if len(new) >= self.ranks and all(_settled(p) for p in new):
                return tuple(new)
            time.sleep(0.5)
        if required:
            raise ProfileError(f"{self.trace_dir}: {len(trace_files(self.trace_dir) - before)} of {self.ranks} "
                               f"rank traces written within {self.write_timeout_s:.0f} s of /stop_profile")
        return ()


    def _await_routing(self, before: set[Path], timeout_s: float | None = None) -> tuple[Path, ...]:
        """The routing counts of the window (written whole by the plugin, by rename)."""
        required = timeout_s is None
        deadline = time.monotonic() + (self.write_timeout_s if required else timeout_s)
        while time.monotonic() < deadline:
            new = sorted(routing_files(self.trace_dir) - before)
            if len(new) >= self.ranks:
                return tuple(new)
            time.sleep(0.2)
        if required:
            raise ProfileError(f"{self.trace_dir}: {len(routing_files(self.trace_dir) - before)} of {self.ranks} "
                               "routing counts written by the server's plugin within "
                               f"{self.write_timeout_s:.0f} s of /stop_profile (--capture-routing)")
        return ()


def _settled(path: Path) -> bool:
    """A trace file whose size no longer changes (the writer has finished)."""
    try:
        size = path.stat().st_size
        time.sleep(0.2)
        return size > 0 and path.stat().st_size == size
    except OSError:
        return False
