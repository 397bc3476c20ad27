"""A reward computed by an HTTP server (`data.reward: http(s)://host:port/path`), as slime's remote reward models
and verl's reward servers run: one POST per sample of `{"prompt", "response", "label", "metadata"}` (the prompt as
the dataset gives it: a string or a list of messages; the label is the problem's answer), answered by a number or
`{"reward": number}`. Requests of a batch go out `concurrency` at a time; a failed one (a connection error or one
dropped mid-answer, a timeout, an HTTP error status, an answer that is not a finite number) is retried `retries`
times with capped exponential backoff (0.5 s, 1 s, 2 s, ... at most 8 s); after the last retry the error names the
sample. `timeout_s` bounds each attempt whole, from connecting to the answer's last byte (`_DeadlineHandler`): a
socket timeout alone bounds each read, and a server that trickles its answer a byte at a time would never end."""

from __future__ import annotations

import functools
import http.client
import io
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from .data import REWARD_RANGE, finite_reward

BACKOFF_S, BACKOFF_CAP_S = 0.5, 8.0


def is_remote(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(("http://", "https://"))


def check_url(url: str) -> str:
    """The URL, if it is http(s)://host[:port][/path]; ValueError naming data.reward otherwise."""
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018 - parsing the port raises on a bad one
    except ValueError as e:
        raise ValueError(f"data.reward: {url!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"data.reward: {url!r} is not an http(s)://host[:port]/path URL")
    return url


def reward_value(answer) -> float:
    """The reward in a server's JSON answer: a number, or {"reward": number}, as `finite_reward` takes it (a JSON
    true is not a reward). ValueError otherwise."""
    value = answer.get("reward") if isinstance(answer, dict) else answer
    number = None if isinstance(value, bool) or not isinstance(value, int | float) else finite_reward(value)
    if number is None:
        raise ValueError(f"expected a finite number or {{\"reward\": number}}, got {json.dumps(answer)[:200]} "
                         f"({REWARD_RANGE})")
    return number


def _time_left(deadline: float) -> float:
    """Seconds until `deadline` (time.monotonic()); TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


class _DeadlineIO(io.RawIOBase):
    """A socket's raw reader (`sock.makefile`'s, which keeps the socket open while it is) whose every read waits at
    most until `deadline`: the status line, the headers and the body together end by it, however slowly the server
    sends them."""

    def __init__(self, sock, deadline: float):
        self.sock, self.raw, self.deadline = sock, sock.makefile("rb", buffering=0), deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b):
        self.sock.settimeout(_time_left(self.deadline))
        return self.raw.readinto(b)

    def close(self):
        self.raw.close()
        super().close()


class _DeadlineResponse(http.client.HTTPResponse):
    def __init__(self, sock, *args, deadline: float, **kwargs):
        super().__init__(sock, *args, **kwargs)
        self.fp.close()  # http.client's reader, not read yet: replaced by one that keeps the deadline
        self.fp = io.BufferedReader(_DeadlineIO(sock, deadline))


class _DeadlineConnection:
    """Mixed into http.client's HTTP and HTTPS connections: connecting and each send wait at most the time left
    (a TLS handshake: each of its reads), the answer is read through `_DeadlineIO`."""

    def __init__(self, *args, deadline: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = deadline
        self.response_class = functools.partial(_DeadlineResponse, deadline=deadline)

    def connect(self):
        self.timeout = _time_left(self.deadline)
        super().connect()

    def send(self, data):
        if self.sock is not None:  # else send connects first, under connect's timeout
            self.sock.settimeout(_time_left(self.deadline))
        super().send(data)


class _DeadlineHTTP(_DeadlineConnection, http.client.HTTPConnection):
    pass


class _DeadlineHTTPS(_DeadlineConnection, http.client.HTTPSConnection):
    pass


class _DeadlineHandler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    """urllib's http and https handlers with `_DeadlineConnection`s ending by `deadline` (time.monotonic()); the rest
    of urllib (proxies, redirects, HTTPError) as urlopen has it."""

    def __init__(self, deadline: float):
        super().__init__()
        self.deadline = deadline

    def do_open(self, http_class, req, **kwargs):
        deadline_class = _DeadlineHTTPS if issubclass(http_class, http.client.HTTPSConnection) else _DeadlineHTTP
        return super().do_open(functools.partial(deadline_class, deadline=self.deadline), req, **kwargs)


def _plain(value):
    """JSON for what a dataset's metadata may hold beyond JSON's types: arrays (numpy's, from Parquet) as lists."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


class RemoteReward:
    """POSTs each sample to `url`; `batch` scores many at once (`concurrency` in flight)."""

    def __init__(self, url: str, *, concurrency: int = 8, retries: int = 3, timeout_s: float = 30.0):
        self.url, self.concurrency, self.retries, self.timeout_s = check_url(url), concurrency, retries, timeout_s

    def _post(self, payload: dict) -> float:
        """One attempt, ended by `timeout_s` after its start whatever the server does."""
        opener = urllib.request.build_opener(_DeadlineHandler(time.monotonic() + self.timeout_s))
        body = json.dumps(payload, default=_plain).encode()
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with opener.open(request, timeout=self.timeout_s) as reply:
            return reward_value(json.loads(reply.read()))

    def one(self, payload: dict, where: str) -> float:
        """The reward of one sample, retried; ValueError naming `where` after the last attempt."""
        for attempt in range(self.retries + 1):
            try:
                return self._post(payload)
            # URLError, HTTPError, timeouts, bad JSON, not a number; and a connection dropped mid-answer
            # (IncompleteRead, BadStatusLine, LineTooLong: http.client.HTTPException, not an OSError)
            except (OSError, ValueError, http.client.HTTPException) as e:
                if attempt == self.retries:
                    raise ValueError(f"{where}: {self.url} failed {attempt + 1} times, last: "
                                     f"{type(e).__name__}: {e}") from None
                time.sleep(min(BACKOFF_S * 2**attempt, BACKOFF_CAP_S))
        raise AssertionError("unreachable")

    def batch(self, payloads: list[dict], wheres: list[str]) -> list[float]:
        """Rewards in the order given; the first failure (after its retries) raises."""
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self.one, payloads, wheres))
