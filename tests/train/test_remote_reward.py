"""`data.reward: http(s)://...`: a loopback reward server (the built-in exact_number reward behind HTTP) with injected
failures, latency and bad answers; the client's concurrency, retries and errors; a training step scored through it
equals the step scored in-process."""

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_pdm.train import remote_reward
from megatron_pdm.train.config import config_from_dict
from megatron_pdm.train.data import exact_number_reward
from megatron_pdm.train.remote_reward import RemoteReward


class RewardServer:
    """exact_number over HTTP. Faults: the first `fail_first` requests answer 500; responses containing "always-500"
    always do; the responses of `ANSWERS` get its answers; every request waits `delay_s`. `in_flight_max`: the most
    requests it held at once."""

    # valid JSON that is not a usable reward: a string, an integer too large for a float, a float beyond float32's
    ANSWERS = {"not-a-number": "high", "a-401-digit-integer": 10**400, "beyond-float32": 1e39}

    def __init__(self):
        self.fail_first, self.delay_s, self.requests, self.in_flight, self.in_flight_max = 0, 0.0, 0, 0, 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests += 1
                    failing = server.fail_first > 0 or "always-500" in body["response"]
                    server.fail_first -= server.fail_first > 0
                    server.in_flight += 1
                    server.in_flight_max = max(server.in_flight_max, server.in_flight)
                try:
                    time.sleep(server.delay_s)
                    reward = server.ANSWERS[body["response"]] if body["response"] in server.ANSWERS else \
                        exact_number_reward(body["response"], body["label"], body["metadata"])
                    answer = json.dumps({"reward": reward} if body["metadata"].get("wrapped") else reward).encode()
                finally:
                    # out of flight before the answer leaves: the client's next request on that connection can
                    # only follow the answer (counted after it, a race reported 5 in flight for 4 workers)
                    with server.lock:
                        server.in_flight -= 1
                if failing:
                    self.send_response(500)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass  # a client that timed out closed the connection before the answer: expected here, not printed

        self.http = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/reward"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(remote_reward, "BACKOFF_S", 0.01)  # the backoff's shape, not its seconds, is under test
    s = RewardServer()
    yield s
    s.close()


def _read_request(conn) -> bytes:
    """A whole request from a raw socket: headers, then the body its Content-Length gives. A server that closed with
    part of it unread would reset the connection (ConnectionResetError at the client) instead of ending it."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        body += conn.recv(65536)
    return data


def _payload(response, label, **metadata):
    return {"prompt": [{"role": "user", "content": "1+1="}], "response": response, "label": label,
            "metadata": metadata}


def test_concurrent_requests_retries_and_both_answer_forms(server):
    server.fail_first, server.delay_s = 3, 0.2  # each request held 0.2 s: the four workers overlap
    payloads = [_payload(f"the answer is {i % 5}", str(i % 3), wrapped=i % 2 == 0) for i in range(16)]
    client = RemoteReward(server.url, concurrency=4, retries=3, timeout_s=5)
    rewards = client.batch(payloads, [f"sample {i}" for i in range(16)])
    assert rewards == [exact_number_reward(p["response"], p["label"], p["metadata"]) for p in payloads]
    assert 2 <= server.in_flight_max <= 4  # in flight together, never more than reward_concurrency
    assert server.requests == 16 + 3  # each injected failure retried once


def test_errors_name_the_sample_after_the_last_retry(server):
    client = RemoteReward(server.url, concurrency=2, retries=2, timeout_s=5)
    payloads = [_payload("4", "4"), _payload("always-500", "4")]
    with pytest.raises(ValueError, match=r"sample 1 .*/reward failed 3 times, last: HTTPError: HTTP Error 500"):
        client.batch(payloads, ["sample 0", "sample 1 (prompt p1)"])
    with pytest.raises(ValueError, match=r'failed 1 times, last: ValueError: expected a finite number or \{"reward"'):
        RemoteReward(server.url, retries=0).batch([_payload("not-a-number", "4")], ["sample 0"])
    server.delay_s = 0.5
    with pytest.raises(ValueError, match=r"failed 2 times, last: .*timed out"):
        RemoteReward(server.url, retries=1, timeout_s=0.1).batch([_payload("4", "4")], ["sample 0"])
    closed = RemoteReward("http://127.0.0.1:9/reward", retries=1, timeout_s=1)  # the discard port: refused
    with pytest.raises(ValueError, match=r"sample 0: http://127.0.0.1:9/reward failed 2 times, last: URLError"):
        closed.batch([_payload("4", "4")], ["sample 0"])


@pytest.mark.parametrize("response, shown", [("a-401-digit-integer", "1" + "0" * 150), ("beyond-float32", "1e+39")])
def test_a_reward_too_large_for_a_float_is_retried_then_names_the_sample(server, response, shown):
    """A 401-digit integer (valid JSON, too large for a float) or a float beyond float32's range (the rewards' dtype,
    where it would train as inf) is a bad answer like any other: retried, then the error names the sample (the
    regression: an uncaught OverflowError for the integer, at the first attempt; inf rewards for the float)."""
    with pytest.raises(ValueError, match=rf'^sample 2: .*/reward failed 2 times, last: ValueError: expected a finite '
                                         rf'number or \{{"reward": number\}}, got \{{"reward": {re.escape(shown)}'):
        RemoteReward(server.url, retries=1).batch([_payload(response, "4", wrapped=True)], ["sample 2"])
    assert server.requests == 2


def _serve_each(listener, handle, *, threaded: bool) -> None:
    """A daemon thread that accepts connections until the listener is closed (the test's end) and hands each to
    `handle`, in a thread of its own when `threaded` (a handler that outlasts the next request)."""

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            if threaded:
                threading.Thread(target=handle, args=(conn,), daemon=True).start()
            else:
                handle(conn)

    threading.Thread(target=accept, daemon=True).start()


def test_a_connection_dropped_mid_answer_is_retried_and_names_the_sample(monkeypatch):
    """A server (or a load balancer) that closes the connection before the body its Content-Length promises: the
    client's http.client.IncompleteRead is an HTTPException, not an OSError, and must be retried like one."""
    monkeypatch.setattr(remote_reward, "BACKOFF_S", 0.01)
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def cut_short(conn):
        with conn:
            accepted.append(_read_request(conn))
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 20\r\n\r\n{\"rew")

    _serve_each(listener, cut_short, threaded=False)
    client = RemoteReward(f"http://127.0.0.1:{listener.getsockname()[1]}/r", retries=2, timeout_s=5)
    try:
        with pytest.raises(ValueError, match=r"sample 0 \(prompt p\): .*/r failed 3 times, last: IncompleteRead"):
            client.batch([_payload("4", "4")], ["sample 0 (prompt p)"])
    finally:
        listener.close()
    assert len(accepted) == 3  # retries + 1 requests


@pytest.mark.parametrize("phase", ["headers", "body"])
def test_a_server_that_trickles_its_answer_is_timed_out_per_attempt(monkeypatch, phase):
    """data.reward_timeout_s bounds an attempt whole, not each socket read: a server that sends its status line and
    headers, or then its body, a byte every 0.1 s (each read far inside the 0.5 s timeout) is cut off at 0.5 s per
    attempt, and the error names the sample (the regression: the client waited as long as the server trickled, here
    14 s or more per attempt, and then took the reward)."""
    monkeypatch.setattr(remote_reward, "BACKOFF_S", 0.01)
    body = b"1" + b" " * 59  # the reward 1, padded: 6 s of body at a byte per 0.1 s
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 60\r\n\r\n"
    listener = socket.create_server(("127.0.0.1", 0))

    def trickle(conn):
        with conn:
            _read_request(conn)
            fast, slow = (b"", head + body) if phase == "headers" else (head, body)
            try:
                conn.sendall(fast)
                for i in range(len(slow)):
                    conn.sendall(slow[i:i + 1])
                    time.sleep(0.1)
            except OSError:  # the client gave up and closed the connection
                return

    _serve_each(listener, trickle, threaded=True)
    client = RemoteReward(f"http://127.0.0.1:{listener.getsockname()[1]}/r", retries=1, timeout_s=0.5)
    start = time.monotonic()
    try:
        with pytest.raises(ValueError, match=r"^sample 3 \(prompt p\): .*/r failed 2 times, last: .*timed out"):
            client.batch([_payload("1", "1")], ["sample 3 (prompt p)"])
    finally:
        listener.close()
    # two attempts of 0.5 s; 5 s leaves a loaded 2-core machine a wide margin, well under the 12 s or more that
    # waiting for the trickle would take
    assert time.monotonic() - start < 5


def test_config_checks_the_url_and_the_limits_at_load():
    for bad, msg in [("http://", r"data.reward: 'http://' is not an http\(s\)://host"),
                     ("https://host:port/x", r"data.reward: 'https://host:port/x': Port could not be cast")]:
        with pytest.raises(ValueError, match=msg):
            config_from_dict({"data": {"reward": bad}})
    with pytest.raises(ValueError, match="data.reward_concurrency: expected an integer >= 1, got 0"):
        config_from_dict({"data": {"reward": "http://127.0.0.1:1/r", "reward_concurrency": 0}})
    with pytest.raises(ValueError, match="data.reward_timeout_s: 0 must be > 0.0"):
        config_from_dict({"data": {"reward_timeout_s": 0}})


def test_a_training_step_scored_through_the_server_equals_the_in_process_one(dist_pools, tmp_path, server):
    from tests.helpers import TRAIN_DENSE, compare_rows, init_checkpoint, rank_train, train_cfg

    init = init_checkpoint(tmp_path, TRAIN_DENSE, dist_pools)
    run = lambda name, **data: dist_pools(1).run(rank_train, shared=(config_from_dict({  # noqa: E731
        **train_cfg(TRAIN_DENSE, {}, init, steps=1, minibatches=1).to_dict(),
        "data": {"max_operand": 2, **data}}), str(tmp_path / name)))[0][0]
    local = run("local")
    remote = run("remote", reward=server.url, reward_concurrency=4)
    compare_rows(remote, local)
    assert [r["train/reward"] for r in remote[1:]] == [r["train/reward"] for r in local[1:]]
    assert server.requests >= 16  # the step's 4 prompts x 4 samples, and the evaluation's
