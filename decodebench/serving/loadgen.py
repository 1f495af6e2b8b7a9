"""The decode load's client: one process, one thread, one ``epoll`` loop over its streams.

The parent (:mod:`.client`) starts one or more of these processes (``python loadgen.py``) and
hands each a job on stdin. Each stream is a keep-alive HTTP/1.1 connection carrying one streamed
``/v1/completions`` request at a time; a chunk is stamped with the kernel's receive time of the
read that carried it (``SO_TIMESTAMPNS``). Why a process with no threads, and what the client's
lag, merged chunks and stalls mean: docs/e2e.md ("The client", "Deadlines, stalls, progress").

Protocol (one JSON object a line): the parent writes the job; the process connects its streams
and answers ``{"ready": true}``; the parent writes ``go``; the process says ``{"progress": ...}``
every ``progress_s``, answers ``{"result": ...}`` when its prompts are used up, and exits. It
stops within half a second of its parent's death. A request succeeds only if its stream and its
count agree (:func:`count_problem`). Nothing here imports decodebench, so the process starts in
a fraction of a second.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import socket
import struct
import sys
import time
import urllib.parse
from collections import deque
from dataclasses import asdict, dataclass, field

# Linux's SO_TIMESTAMPNS / SCM_TIMESTAMPNS (asm-generic/socket.h); Python does not export them.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_TIMESPEC = struct.Struct("qq")
READ_BYTES = 1 << 18
_BODY_BYTES = 4096  # of an error response's body, kept for the error


@dataclass
class Request:
    """One streamed request's stamps (seconds, ``time.time()``, the kernel's clock for arrivals); the
    parent reads it back as :class:`.stream.RequestResult`.

    >>> round(Request(start=0.0, ttft=0.1, latency=0.73, output_tokens=64).tpot, 6)
    0.01
    """

    start: float
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None
    output_tokens: int | None = None
    error: str | None = None
    body: str = ""  # an error response's first bytes (the parent words them: handle.body_excerpt)
    chunks: int = 0  # chunks carrying a token
    merged: int = 0  # chunks stamped by a later step's segment (read together with the next chunk of this stream)
    first_merged: bool = False  # the first token chunk was among them (its TTFT stamp may be late)
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per chunk (continuous usage only)
    stalled: bool = False  # the stream received nothing for the job's stall_s
    last: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None

    @property
    def tpot(self) -> float | None:
        """``(latency - ttft) / (output_tokens - 1)``, None for fewer than 2 tokens."""
        if not self.ok or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


class Response:
    """An HTTP/1.1 response read incrementally: its head, then a body that is chunked (vLLM's
    streams), of a Content-Length (an error), or delimited by the connection's close (HTTP/1.0).

    >>> r = Response()
    >>> r.feed(b"HTTP/1.1 200 OK\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n5\\r\\nhel"), r.status
    (b'hel', 200)
    >>> r.feed(b"lo\\r\\n0\\r\\n\\r\\n"), r.done, r.keep_alive
    (b'lo', True, True)
    """

    def __init__(self) -> None:
        self.raw = bytearray()  # bytes taken from the socket and not yet decoded (a partial unit)
        self.status: int | None = None
        self.reason = ""
        self.mode = ""  # "chunked", "length" or "close", once the head is read
        self.left = 0  # bytes of the body (length) or of the current chunk's data (chunked) still to come
        self.crlf = 0  # bytes of the current chunk's closing CRLF still to come
        self.keep_alive = True
        self.done = False
        self.content_type = ""

    def feed(self, data: bytes) -> bytes:
        """Decode ``data``; returns the body bytes it completed (``done`` once the body has ended)."""
        self.raw += data
        body = bytearray()
        while not self.done and self._step(body):
            pass
        return bytes(body)

    def eof(self) -> None:
        """The connection closed: the end of a close-delimited body, a cut-off one otherwise."""
        if self.mode == "close":
            self.done = True
        self.keep_alive = False

    def _step(self, body: bytearray) -> bool:
        if self.status is None:
            cut = self.raw.find(b"\r\n\r\n")
            if cut < 0:
                return False
            self._head(bytes(self.raw[:cut]).decode("latin-1"))
            del self.raw[:cut + 4]
            return True
        if self.mode == "chunked":
            return self._chunk(body)
        take = bytes(self.raw) if self.mode == "close" else bytes(self.raw[:self.left])
        del self.raw[:len(take)]
        body += take
        if self.mode == "length":
            self.left -= len(take)
            self.done = self.left == 0
        return False

    def _head(self, text: str) -> None:
        lines = text.split("\r\n")
        version, status, *reason = lines[0].split(" ", 2)
        self.status, self.reason = int(status), "".join(reason)
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        self.content_type = headers.get("content-type", "")
        connection = headers.get("connection", "").lower()
        self.keep_alive = (connection != "close") if version == "HTTP/1.1" else connection == "keep-alive"
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.mode = "chunked"
        elif "content-length" in headers:
            self.mode, self.left = "length", int(headers["content-length"])
            self.done = self.left == 0
        else:
            self.mode, self.keep_alive = "close", False

    def _chunk(self, body: bytearray) -> bool:
        if self.left == 0 and self.crlf == 0:  # at a chunk's size line
            line = self.raw.find(b"\r\n")
            if line < 0:
                return False
            size = int(bytes(self.raw[:line]).split(b";")[0] or b"0", 16)
            if size == 0:
                if len(self.raw) < line + 4:
                    return False
                del self.raw[:line + 4]  # the last chunk and its empty trailer
                self.done = True
                return False
            del self.raw[:line + 2]
            self.left, self.crlf = size, 2
        take = bytes(self.raw[:self.left])
        del self.raw[:len(take)]
        body += take
        self.left -= len(take)
        if self.left:
            return False
        end = min(self.crlf, len(self.raw))
        del self.raw[:end]
        self.crlf -= end
        return self.crlf == 0 and bool(self.raw)


class Stream:
    """One connection and the request it carries; fed socket reads, it stamps the request's chunks."""

    def __init__(self, job: dict) -> None:
        self.job = job
        self.sock: socket.socket | None = None
        self.response = Response()
        self.reusable = False  # the connection may carry the next request (False: reconnect first)
        self.sse = bytearray()
        self.request: Request | None = None
        self.body = bytearray()  # an error response's body
        self.done_marker = False
        self.last_usage = 0
        self.usage_text = ""  # the usage event as the server sent it, for an error that quotes it
        self.deadline = 0.0
        self.heard = 0.0  # when the stream last received bytes (or its request was sent)
        self.number = 0  # the request's number among the round's prompts (1-based)
        self.outbox = b""
        self.sent = 0
        self.connecting = False

    def prepare(self, prompt: list[int], number: int = 0) -> None:
        """Queue the request for ``prompt``, the round's request ``number`` (the loop writes it once the
        connection is up)."""
        job = self.job
        body = json.dumps({"model": job["model"], "prompt": prompt, "max_tokens": job["output_len"],
                           "ignore_eos": True, "temperature": 0.0, "stream": True,
                           "stream_options": {"include_usage": True,
                                              "continuous_usage_stats": bool(job.get("chunk_tokens"))}}).encode()
        head = [f"POST {job['path']} HTTP/1.1", f"Host: {job['host_header']}", "Content-Type: application/json",
                f"Content-Length: {len(body)}", "Connection: keep-alive",
                *(f"{k}: {v}" for k, v in job["headers"].items())]
        self.outbox = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        self.response = Response()
        self.sse.clear(), self.body.clear()
        self.done_marker, self.last_usage, self.usage_text = False, 0, ""
        self.request = Request(start=time.time())  # restamped when its first byte is written
        self.deadline = self.heard = self.request.start
        self.deadline += job["timeout_s"]
        self.number = number
        self.sent = 0

    def write(self) -> bool:
        """Write what the socket takes of the request; True once all of it is out."""
        if self.sent == 0:
            self.request.start = self.heard = time.time()  # the clock starts as the request leaves, as bench serve's
        self.sent += self.sock.send(self.outbox[self.sent:])
        return self.sent == len(self.outbox)

    def feed(self, data: bytes, arrived: float) -> bool:
        """Take one unit's bytes (``b""``: the connection closed), stamped ``arrived``; True when the
        request has ended."""
        response = self.response
        headless = response.status is None
        if not data:
            response.eof()
        body = response.feed(data) if data else b""
        if headless and response.status is not None:
            self.heard = arrived  # the head is progress; within an event stream, only its data events are
        if response.status is not None and response.status != 200 or not _is_event_stream(response):
            self.body += body[:_BODY_BYTES - len(self.body)]
            self.heard = arrived if body else self.heard
        elif body:
            self.sse += body
            self._lines(arrived)
        if response.done or not data:
            self._end()
            return True
        return False

    def _lines(self, arrived: float) -> None:
        while (cut := self.sse.find(b"\n")) >= 0:
            line = bytes(self.sse[:cut]).strip()
            del self.sse[:cut + 1]
            if line.startswith(b"data:"):  # not a comment (": ping") or a blank separator: those are no progress
                self.heard = arrived
                self._event(line[5:].strip(), arrived)

    def _event(self, data: bytes, arrived: float) -> None:
        request = self.request
        if data == b"[DONE]":
            self.done_marker = True
            return
        try:
            message = json.loads(data)
        except ValueError:
            message = data  # not JSON: said below as what the server sent
        usage = (message.get("usage") or {}) if isinstance(message, dict) else None
        if not isinstance(usage, dict):
            what = "an event that is no JSON object" if usage is None else "a usage that is no JSON object"
            request.error = request.error or (f"the server sent {what} after {request.chunks} token chunks: "
                                              f"data: {_quote(data)}")
            return
        if message.get("error"):
            request.error = request.error or f"server error in stream: {json.dumps(message['error'])[:1000]}"
            return
        if message.get("choices"):
            if request.ttft is None:
                request.ttft = arrived - request.start
            else:
                request.itl.append(arrived - request.last)
                if arrived == request.last:  # taken in one read with the chunk before: both carry this stamp
                    request.merged += 1
                    request.first_merged |= request.chunks == 1
            request.last = arrived
            request.chunks += 1
            if isinstance(usage.get("completion_tokens"), int):
                request.chunk_tokens.append(usage["completion_tokens"] - self.last_usage)
                self.last_usage = usage["completion_tokens"]
        elif "completion_tokens" in usage:
            request.output_tokens = usage["completion_tokens"]
            self.usage_text = _quote(data)

    def _end(self) -> None:
        request, response = self.request, self.response
        if response.status is None:
            request.error = request.error or "the connection closed before a response"
        elif response.status != 200 and request.error is None:
            request.error = f"HTTP {response.status} {response.reason}".rstrip()
            request.body = self.body.decode("utf-8", errors="replace")
        elif not _is_event_stream(response) and request.error is None:
            request.error = f"HTTP 200 but no event stream (Content-Type {response.content_type or 'absent'!r})"
            request.body = self.body.decode("utf-8", errors="replace")
        elif request.error is None and not self.done_marker:
            request.error = f"the stream ended without data: [DONE] (token chunks received: {request.chunks})"
        elif request.error is None and request.ttft is None:
            request.error = "the stream ended without a chunk carrying a token"
        if request.error is None:
            request.error = count_problem(request.output_tokens, self.usage_text, request.chunks,
                                          self.job["output_len"])
        if request.error is None:
            request.latency = request.last - request.start
            if request.output_tokens is None:
                request.output_tokens = request.chunks
        self.reusable = response.done and response.keep_alive and request.error is None


def count_problem(usage_tokens, usage_text: str, chunks: int, asked: int) -> str | None:
    """Why a finished stream's token count cannot be trusted, quoting the server, or None.

    ``usage_tokens``: the usage's ``completion_tokens`` (None: no usage event, the token chunks
    count); ``usage_text``: that event as sent; ``asked``: the request's ``max_tokens``.

    >>> count_problem(8, "", 8, 8) is None
    True
    >>> print(count_problem(0, '{"usage": {"completion_tokens": 0}}', 8, 8))
    usage says 0 tokens, 8 streamed (token chunks): the server sent data: {"usage": {"completion_tokens": 0}}
    >>> print(count_problem(None, "", 80, 8))
    the server made 80 tokens (no usage event: token chunks), 8 asked (max_tokens with ignore_eos)
    """
    if usage_tokens is None:
        made = f"{chunks} tokens (no usage event: token chunks)"
    elif type(usage_tokens) is not int or usage_tokens < chunks:
        return (f"usage says {usage_tokens!r} tokens, {chunks} streamed (token chunks): the server sent "
                f"data: {usage_text}")
    else:
        made = f"{usage_tokens} tokens (usage)"
    if (chunks if usage_tokens is None else usage_tokens) != asked:
        return f"the server made {made}, {asked} asked (max_tokens with ignore_eos)"
    return None


def _quote(data: bytes) -> str:
    """An event's text as the server sent it, cut to a line's length."""
    text = data.decode("utf-8", errors="replace")
    return text if len(text) <= 200 else f"{text[:199]}… ({len(text)} characters)"


def _is_event_stream(response: Response) -> bool:
    """Whether a 200 response is a server-sent event stream (an error status is judged by its status).

    >>> r = Response(); _ = r.feed(b"HTTP/1.1 200 OK\\r\\nContent-Type: text/html\\r\\nContent-Length: 0\\r\\n\\r\\n")
    >>> _is_event_stream(r)
    False
    """
    return response.status != 200 or response.content_type.split(";")[0].strip().lower() == "text/event-stream"


def arrival(ancdata, fallback: float) -> tuple[float, bool]:
    """The kernel's receive stamp of a read (``SCM_TIMESTAMPNS``), or ``fallback`` without one.

    >>> arrival([(socket.SOL_SOCKET, SO_TIMESTAMPNS, _TIMESPEC.pack(12, 500_000_000))], 99.0)
    (12.5, True)
    >>> arrival([], 99.0)
    (99.0, False)
    """
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
            seconds, nanos = _TIMESPEC.unpack_from(data)
            return seconds + nanos * 1e-9, True
    return fallback, False


def connect(job: dict) -> socket.socket:
    """A non-blocking socket whose connection to the server is under way (the loop waits for it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in job["host"] else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        pass  # no kernel stamps here: reads are stamped when Python sees them, and the result says so
    sock.setblocking(False)
    sock.connect_ex((job["host"], job["port"]))  # EINPROGRESS; a refusal shows when it turns writable
    return sock


class Loop:
    """The job's streams on one selector until its prompts are used up."""

    def __init__(self, job: dict) -> None:
        self.job = job
        self.prompts = deque(enumerate(job["prompts"]))
        self.selector = selectors.DefaultSelector()
        self.streams = [Stream(job) for _ in range(min(job["streams"], len(self.prompts)))]
        self.results: list[dict] = []
        self.lag: list[float] = []
        self.cpu: list[float] = []
        self.stamped = 0  # reads that carried the kernel's stamp
        self.stalled: str | None = None  # the stalled request's error: the load ends
        self.say = lambda message: None  # where progress goes (main: the parent's pipe)

    def run(self) -> None:
        """Run every prompt; stop when the process that wrote the job is gone (its pid is the job's
        ``parent``: read here, after the go, ``getppid`` would already name the reaper when that
        process was killed while this one waited for the CPU; None: the loop runs in that process)."""
        parent = self.job.get("parent", os.getppid())
        every, told = self.job.get("progress_s", 5.0), time.time()
        for index, stream in enumerate(self.streams):
            self._next(index, stream)
        while self.selector.get_map():
            for key, mask in self.selector.select(timeout=0.5):
                if mask & selectors.EVENT_WRITE:
                    self._write(key.data)
                else:
                    self._read(key.data)
            self._expire()
            if parent is not None and os.getppid() != parent:  # the process that started this one was killed
                raise SystemExit(f"loadgen: parent process {parent} is gone; {len(self.prompts)} prompts not sent")
            if time.time() - told >= every:
                told = time.time()
                self.say({"progress": self.progress()})

    def progress(self) -> dict:
        """Requests ended so far, how many failed, and the token chunks their streams received."""
        return {"done": len(self.results), "failed": sum(r["error"] is not None for r in self.results),
                "tokens": sum(r["output_tokens"] or r["chunks"] for r in self.results)}

    def _next(self, index: int, stream: Stream) -> None:
        """Queue the stream's next prompt (on a new connection after an error), or retire the stream."""
        if not self.prompts or self.stalled:
            self._close(stream)
            return
        if not stream.reusable or stream.sock is None:
            self._close(stream)
            stream.sock = connect(self.job)
            stream.connecting = True
        number, prompt = self.prompts.popleft()
        stream.prepare(prompt, self.job.get("first", 0) + number * self.job.get("step", 1) + 1)
        self.selector.register(stream.sock, selectors.EVENT_WRITE, (index, stream))

    def _write(self, data) -> None:
        index, stream = data
        try:
            if stream.connecting:
                error = stream.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    raise ConnectionError(error, os.strerror(error))
                stream.connecting = False
            if stream.write():
                self.selector.modify(stream.sock, selectors.EVENT_READ, data)
        except BlockingIOError:
            return
        except OSError as exc:  # refused or reset: this prompt failed, the next one gets a new connection
            stream.request.error = f"{type(exc).__name__}: {exc}"
            stream.reusable = False
            self._finish(index, stream)

    def _read(self, data) -> None:
        """Take what waits on the stream's socket in one read, stamped with its last segment's arrival.

        (Reading it unit by unit would not give earlier units their own stamps: the kernel
        coalesces segments that queue unread into one, keeping the latest stamp.)
        """
        index, stream = data
        try:
            payload, ancdata, _, _ = stream.sock.recvmsg(READ_BYTES, socket.CMSG_SPACE(_TIMESPEC.size))
            self._take(index, stream, payload, ancdata, time.time())
        except BlockingIOError:
            return
        except (OSError, ValueError) as exc:  # reset, or bytes that are no HTTP response
            stream.request.error = stream.request.error or f"{type(exc).__name__}: {exc}"
            stream.reusable = False
            self._finish(index, stream)

    def _take(self, index: int, stream: Stream, payload: bytes, ancdata, seen: float) -> bool:
        """Feed one unit; True when its request ended (the stream then moves on)."""
        arrived, stamped = arrival(ancdata, seen)
        if payload:  # the end-of-stream read carries no data and no stamp
            self.stamped += stamped
            self.lag.append(seen - arrived)
        ended = stream.feed(payload, arrived)
        if payload:
            self.cpu.append(time.time() - seen)
        if ended:
            self._finish(index, stream)
        return ended

    def _finish(self, index: int, stream: Stream) -> None:
        self.results.append(asdict(stream.request))
        try:
            self.selector.unregister(stream.sock)
        except (KeyError, ValueError):
            pass
        self._next(index, stream)

    def _expire(self) -> None:
        """End a request past its deadline; on a stalled stream, end the load (:meth:`_stall`)."""
        now = time.time()
        for key in list(self.selector.get_map().values()):
            index, stream = key.data
            request, tokens = stream.request, stream.request.chunks
            if now > stream.deadline:
                request.error = (f"{self._name(stream)} passed its {self.job['timeout_s']:g} s deadline "
                                 f"after {now - request.start:.1f} s, {tokens} token chunks received")
            elif now - stream.heard > (self.job.get("stall_s") or math.inf):
                request.error = (f"{self._name(stream)} stalled: no data event for {now - stream.heard:.1f} s "
                                 f"(limit {self.job['stall_s']:g} s) after {tokens} token chunks")
                self.stalled, request.stalled = request.error, True
            else:
                continue
            stream.reusable = False
            self._finish(index, stream)
        if self.stalled:
            self._stall(now)

    def _stall(self, now: float) -> None:
        """Cut off the requests in flight and record the prompts left as not sent: a stalled stream
        ends the load, which is failed anyway, within the stall limit."""
        for key in list(self.selector.get_map().values()):
            index, stream = key.data
            stream.request.error = f"{self._name(stream)} cut off: {self.stalled}"
            stream.reusable = False
            self._finish(index, stream)
        while self.prompts:
            number, _ = self.prompts.popleft()
            request = Request(start=now, error=f"not sent: {self.stalled}")
            self.results.append(asdict(request))

    def _name(self, stream: Stream) -> str:
        return self.job.get("label") or f"request {stream.number} of {self.job.get('total', len(self.job['prompts']))}"

    def _close(self, stream: Stream) -> None:
        if stream.sock is not None:
            try:
                self.selector.unregister(stream.sock)
            except (KeyError, ValueError):
                pass
            stream.sock.close()
            stream.sock = None


def job_for(base_url: str, model: str, headers: dict, prompts: list, output_len: int, streams: int,
            timeout_s: float, chunk_tokens: bool = False, *, stall_s: float = float("inf"), progress_s: float = 5.0,
            numbering: tuple[int, int, int] | None = None, label: str | None = None) -> dict:
    """The job a load-generator process runs (JSON-serialisable), for a generator this process starts.

    ``stall_s``: a stream that receives nothing for this long ends the load; ``progress_s``: how often
    the process reports progress; ``numbering`` (first, step, total): the round's numbers of the
    prompts, when they are dealt out among several processes (prompt ``i`` here is request
    ``first + i * step + 1`` of ``total``); ``label``: what errors call a request instead
    ("the warm-up's first request").

    >>> job = job_for("http://127.0.0.1:8000", "m", {}, [[1, 2]], 16, 1, 60.0)
    >>> job["host"], job["port"], job["path"]
    ('127.0.0.1', 8000, '/v1/completions')
    """
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme != "http":
        raise ValueError(f"the load client speaks plain HTTP only, not {parts.scheme!r} ({base_url})")
    port = parts.port or 80
    return {"host": parts.hostname, "port": port, "host_header": parts.netloc, "path": parts.path.rstrip("/") +
            "/v1/completions", "model": model, "headers": dict(headers), "prompts": prompts,
            "output_len": output_len, "streams": streams, "timeout_s": timeout_s, "chunk_tokens": chunk_tokens,
            "stall_s": stall_s if math.isfinite(stall_s) else None, "progress_s": progress_s,
            **dict(zip(("first", "step", "total"), numbering or (0, 1, len(prompts)), strict=True)), "label": label,
            "parent": os.getpid()}  # the process that starts the generator: it stops when that one is gone


def summary(values: list[float]) -> dict[str, float | None]:
    """Median, 99th percentile and maximum of a list (None when empty).

    >>> summary([1.0, 2.0, 3.0])
    {'p50': 2.0, 'p99': 3.0, 'max': 3.0}
    """
    if not values:
        return {"p50": None, "p99": None, "max": None}
    ordered = sorted(values)
    return {"p50": ordered[len(ordered) // 2], "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "max": ordered[-1]}


def main() -> int:
    job = json.loads(sys.stdin.readline())
    out = sys.stdout

    def say(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    loop = Loop(job)
    loop.say = say
    say({"ready": True, "streams": len(loop.streams)})
    if sys.stdin.readline().strip() != "go":
        return 1
    started = time.time()
    loop.run()
    say({"result": {"requests": loop.results, "started": started, "ended": time.time(), "lag": summary(loop.lag),
                    "cpu": summary(loop.cpu), "reads": len(loop.lag), "stamped": loop.stamped}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
