"""A reward computed by an HTTP server (`data.reward: http(s)://host:port/path`), as slime's remote reward models
and verl's reward servers run: one POST per sample of `{"prompt", "response", "label", "metadata"}` (the prompt as
the dataset gives it: a string or a list of messages; the label is the problem's answer), answered by a number or
`{"reward": number}`. Requests of a batch go out `concurrency` at a time; a failed one (a connection error or one
dropped mid-answer, a timeout, an HTTP error status, an answer that is not a finite number) is retried `retries`
times with capped exponential backoff (0.5 s, 1 s, 2 s, ... at most 8 s); after the last retry the error names the
sample."""

from __future__ import annotations

import http.client
import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

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
    """The reward in a server's JSON answer: a number, or {"reward": number}; finite. ValueError otherwise."""
    value = answer.get("reward") if isinstance(answer, dict) else answer
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"expected a finite number or {{\"reward\": number}}, got {json.dumps(answer)[:200]}")
    return float(value)


def _plain(value):
    """JSON for what a dataset's metadata may hold beyond JSON's types: arrays (numpy's, from Parquet) as lists."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


class RemoteReward:
    """POSTs each sample to `url`; `batch` scores many at once (`concurrency` in flight)."""

    def __init__(self, url: str, *, concurrency: int = 8, retries: int = 3, timeout_s: float = 30.0):
        self.url, self.concurrency, self.retries, self.timeout_s = check_url(url), concurrency, retries, timeout_s

    def _post(self, payload: dict) -> float:
        body = json.dumps(payload, default=_plain).encode()
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:  # noqa: S310 - the user's URL
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
