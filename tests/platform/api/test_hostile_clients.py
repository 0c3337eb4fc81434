"""Hostile clients, round two: what a tenant can do with its sockets rather than its bodies.

A real gateway (uvicorn on loopback, keys mode, SQLite) in a thread of the test process, so the
tests can hold sockets the way a hostile client does (open and never read, half-sent) and still
read the engine's state. Each test states the bound it checks; each fails on a gateway without the
limit it covers (an unbounded per-request queue, no write timeout, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from support.gateway import bearer
from support.hostile import (
    BACKLOG,
    MAX_CONNECTIONS,
    RSS_BOUND_BYTES,
    STALL_S,
    WRITE_TIMEOUT_S,
    Live,
    live,
    rss_bytes,
)
from support.servers import wait_until

__all__ = ["live"]  # the fixture (support.hostile), used by every test here


def _raw_request(
    live: Live, path: str, body: dict[str, object], key: str, rcvbuf: int = 4096
) -> socket.socket:
    """Send a whole request on a socket with a tiny receive buffer, and read nothing back."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window
    sock.connect(live.host_port)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


@pytest.mark.slow
def test_a_stalled_stream_reader_is_aborted_and_costs_bounded_memory(live: Live) -> None:
    """Class 1: a client that opens n=16 long streams and never reads. The engine's outputs for it
    coalesce (a backlog of one per request), the write times out after ``stream_write_timeout_s``,
    the request is aborted and its 16 sequences released (the tenant may have 24 in flight):
    it is served again, with the socket still open."""
    before = rss_bytes()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2000, "n": 16, "stream": True, "logprobs": 5}
    body |= {"ignore_eos": True, "temperature": 1.0}
    sock = _raw_request(live, "/v1/completions", body, live.alice)
    try:
        wait_until(lambda: live.engine.stats.num_running > 0, 30, "the stalled request to start")
        started = time.monotonic()
        # The slot frees within the write timeout (plus the time to fill the socket's buffers).
        freed_s = wait_until(
            lambda: live.engine.stats.num_running == 0, WRITE_TIMEOUT_S + 10, "the stalled request aborted"
        )
        grown = rss_bytes() - before
        assert grown < RSS_BOUND_BYTES, f"+{grown >> 20} MiB for one stalled reader"
        held = asyncio.run(live.engine.inspect(lambda engine: list(engine.requests)))
        assert not held, "the engine still holds the stalled request"
        with httpx.Client(base_url=live.url, timeout=30) as client:
            again = client.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "n": 16},
                headers=bearer(live.alice),
            )
        assert again.status_code == 200, again.text  # the slot is free while the socket is open
        assert time.monotonic() - started < WRITE_TIMEOUT_S + 10, freed_s
    finally:
        sock.close()


def test_a_flood_of_chat_messages_is_refused_before_templating(live: Live) -> None:
    """Class 4: 200,000 tiny messages (a 6 MB body) are refused on their count, in under 2 s
    (templating and tokenizing them took 16-19 s; parsing the 6 MB body alone takes ~0.4 s, more on
    a loaded machine),
    before one of them is validated, templated or tokenized."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "a"}] * 200_000}
    data = json.dumps(body).encode()
    with httpx.Client(base_url=live.url, timeout=60) as client:
        started = time.monotonic()
        response = client.post(
            "/v1/chat/completions",
            content=data,
            headers={**bearer(live.alice), "Content-Type": "application/json"},
        )
        took_s = time.monotonic() - started
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "200000 entries" in error["message"], error
    assert took_s < 2.0, f"refused after {took_s:.2f} s"


def test_n_counts_against_concurrency_as_sequences(live: Live) -> None:
    """Class 4: n is sequences. A tenant limited to one request at a time cannot run n=16 (it
    would run 16 sequences); a tenant past the process's sequence cap waits its turn (429)."""
    with httpx.Client(base_url=live.url, timeout=60) as client:
        over = client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "n": 2},
            headers=bearer(live.mallory),
        )
        assert over.status_code == 429, over.text
        assert "2 sequences" in over.json()["error"]["message"]
        one = client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
            headers=bearer(live.mallory),
        )
        assert one.status_code == 200, one.text

        long = {"model": "tiny", "prompt": "hi", "max_tokens": 1500, "stream": True, "ignore_eos": True}
        stop = threading.Event()
        started = [threading.Event(), threading.Event()]

        def read(n: int, started: threading.Event) -> None:
            # Reads on (a stream nobody reads is aborted after the write timeout), until told.
            with (
                httpx.Client(base_url=live.url, timeout=60) as reader,
                reader.stream(
                    "POST", "/v1/completions", json=long | {"n": n}, headers=bearer(live.alice)
                ) as response,
            ):
                assert response.status_code == 200
                for _ in response.iter_lines():
                    started.set()
                    if stop.is_set():
                        return

        readers = [threading.Thread(target=read, args=(n, e)) for n, e in zip((16, 8), started, strict=True)]
        for thread in readers:
            thread.start()
        try:
            for event in started:
                assert event.wait(30), "a stream did not start"
            third = client.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
                headers=bearer(live.alice),
            )
            assert third.status_code == 429, third.text
            assert "sequence limit" in third.json()["error"]["message"]
        finally:
            stop.set()
            for thread in readers:
                thread.join(60)
        # The streams closed: their sequences are released.
        wait_until(lambda: live.engine.stats.num_running == 0, 30, "the closed streams aborted")
        fourth = client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
            headers=bearer(live.alice),
        )
        assert fourth.status_code == 200, fourth.text


class HealthWatch:
    """Polls /health from a thread while an attack runs; records the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst_s = 0.0
        self.num_polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                assert client.get("/health").status_code == 200
                self.worst_s = max(self.worst_s, time.monotonic() - started)
                self.num_polls += 1
                time.sleep(0.02)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def test_an_answer_over_the_size_cap_is_refused_up_front(live: Live) -> None:
    """Class 2: n=16 x 2,000 tokens x top_logprobs=20 is within every per-field limit, but the whole
    answer could hold 672,000 logprob entries: refused with 400 before anything runs."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "n": 16,
        "max_tokens": 2000,
        "logprobs": True,
        "top_logprobs": 20,
    }
    with httpx.Client(base_url=live.url, timeout=30) as client:
        started = time.monotonic()
        refused = client.post("/v1/chat/completions", json=body, headers=bearer(live.alice))
        took_s = time.monotonic() - started
        assert refused.status_code == 400, refused.text
        assert "672000 logprob entries" in refused.json()["error"]["message"]
        assert took_s < 0.5 and live.engine.stats.num_running == 0
        streamed = client.post(
            "/v1/chat/completions", json=body | {"stream": True, "max_tokens": 2}, headers=bearer(live.alice)
        )
        assert streamed.status_code == 200, streamed.text  # a stream is sent as it comes: not capped


@pytest.mark.slow
def test_health_answers_while_maximal_answers_are_built(live: Live) -> None:
    """Class 2: three answers at the size cap at once; /health keeps answering within a second while
    they are built and encoded (in worker threads, not on the event loop)."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "n": 16,
        "max_tokens": 200,
        "logprobs": True,
        "top_logprobs": 20,
        "ignore_eos": True,
    }
    sizes: list[int] = []

    def ask(key: str) -> None:
        with httpx.Client(base_url=live.url, timeout=300) as client:
            answer = client.post("/v1/chat/completions", json=body, headers=bearer(key))
            assert answer.status_code == 200, answer.text[:300]
            sizes.append(len(answer.content))

    # Three tenants: one tenant's 48 sequences would pass the per-tenant sequence cap.
    askers = [threading.Thread(target=ask, args=(key,)) for key in (live.alice, *live.others)]
    with HealthWatch(live.url) as watch:
        for thread in askers:
            thread.start()
        for thread in askers:
            thread.join(300)
    assert len(sizes) == 3 and min(sizes) > 3_000_000, sizes
    assert watch.num_polls > 10 and watch.worst_s < STALL_S, (watch.worst_s, watch.num_polls)


SLOWLORIS = """
import socket, sys, time
host, port, n, duration = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
socks, opened, end = [], 0, time.monotonic() + duration
while time.monotonic() < end:
    burst_end = time.monotonic() + 0.5
    while len(socks) < n and time.monotonic() < burst_end:  # keep n half-sent requests open
        s = socket.socket()
        s.settimeout(0.2)  # a full accept queue drops the SYN: try the next one soon
        try:
            s.connect((host, port))
            s.sendall(b"GET /health HTTP/1.1\\r\\nHost: x\\r\\n")
        except OSError:
            s.close()
            continue
        s.setblocking(False)
        socks.append(s)
        opened += 1
    time.sleep(0.2)  # then reopen what the server closed, five times a second
    alive = []
    for s in socks:
        try:
            closed = True  # closed, or answered (a 503 refusal): reconnect either way
            s.recv(4096)
        except BlockingIOError:
            closed = False
        except OSError:
            pass
        if closed:
            s.close()
        else:
            alive.append(s)
    socks = alive
print(opened)
"""


SYN_RETRY_S = 1.0
"""Linux's initial TCP retransmission timeout: what a connect costs when its SYN is dropped."""


def _timed_request(host: str, port: int, request: bytes) -> tuple[float, float, bytes]:
    """Send one HTTP/1.1 request on a fresh connection: (seconds to connect, seconds from connected
    to the whole answer, the answer's bytes)."""
    started = time.monotonic()
    with socket.create_connection((host, port), timeout=30) as sock:
        connected = time.monotonic()
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return connected - started, time.monotonic() - connected, b"".join(chunks)


def _open_sockets() -> int:
    """Sockets this process holds open (the server's connections among them)."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed since it was listed
            count += os.readlink(f"/proc/self/fd/{name}").startswith("socket:")
    return count


@pytest.mark.slow
def test_half_open_connections_beyond_the_fd_limit_leave_others_served(live: Live) -> None:
    """Class 3: 600 connections that never finish their headers, those the server closes reopened
    five times a second, against a process allowed 200 more open files: /health and another tenant's
    completion still answer within a second of being connected (the connect itself may wait one SYN
    retransmission when the flood has filled the kernel's accept queue), and the server never holds more than
    ``max_connections`` of them plus the accept batches (the rest are evicted or refused, the slow
    ones time out)."""
    host, port = live.host_port
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_before = len(os.listdir("/proc/self/fd"))
    sockets_before = _open_sockets()
    attacker = subprocess.Popen(
        [sys.executable, "-c", SLOWLORIS, host, str(port), "600", "6"], stdout=subprocess.PIPE, text=True
    )
    worst = {"health": 0.0, "completion": 0.0}
    worst_connect = 0.0
    most_sockets = 0
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
    requests = {
        "health": b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "completion": (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            f"Authorization: Bearer {live.others[0]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body,
    }
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_before + 200, hard))
    try:
        time.sleep(1.0)  # the attack is at full strength
        end = time.monotonic() + 4
        while time.monotonic() < end:
            for what, request in requests.items():
                connect_s, answer_s, answer = _timed_request(host, port, request)
                assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
                worst[what] = max(worst[what], answer_s)
                worst_connect = max(worst_connect, connect_s)
            most_sockets = max(most_sockets, _open_sockets())
            time.sleep(0.05)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        out, _ = attacker.communicate(timeout=30)
    assert attacker.returncode == 0
    assert int(out) > 200, out  # more half-open connections than the 200 files the process may open
    assert worst["health"] < STALL_S and worst["completion"] < STALL_S, worst
    # The kernel's accept queue (BACKLOG deep here) is shared with the flood: a SYN that finds it
    # full is dropped and resent after the kernel's 1 s initial retransmission timeout. At most one
    # such retry, never a refusal or a timeout.
    assert worst_connect < SYN_RETRY_S + STALL_S, worst_connect
    # Sockets, not every descriptor: the process also opens files while it serves (SQLite's journal
    # and pooled connections for the usage the completions record), which are not connections held.
    assert most_sockets < sockets_before + MAX_CONNECTIONS + 2 * BACKLOG, (most_sockets, sockets_before)


def test_every_response_says_nosniff(live: Live) -> None:
    """Class 6: JSON errors, probes and answers all carry X-Content-Type-Options: nosniff."""
    with httpx.Client(base_url=live.url, timeout=30) as client:
        answers = [
            client.get("/health"),
            client.get("/v1/models"),  # 401, no key
            client.post(
                "/v1/completions",
                content=b"{",
                headers={**bearer(live.alice), "Content-Type": "application/json"},
            ),
            client.get("/no/such/path"),
            client.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
                headers=bearer(live.alice),
            ),
        ]
    assert [a.status_code for a in answers] == [200, 401, 400, 404, 200]
    for answer in answers:
        assert answer.headers.get("x-content-type-options") == "nosniff", (answer.request.url, answer.headers)


def test_forwarded_for_is_not_believed_by_default(live: Live) -> None:
    """Class 6: trusted_proxies is empty by default, so X-Forwarded-For from a loopback peer is not
    taken as the client's address (the sign-in limiter would otherwise be bypassed by rotating it)."""
    config = live.server.uvicorn.config
    assert config.proxy_headers is False


def test_a_client_leaving_mid_body_is_a_499_not_a_500(live: Live, caplog: pytest.LogCaptureFixture) -> None:
    """Class 6: a body cut short by the client is logged as the client's doing, never a 500."""
    host, port = live.host_port
    with caplog.at_level("INFO"), socket.create_connection((host, port)) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {live.alice}\r\n"
            'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"model": '.encode()
        )
        time.sleep(0.3)
        sock.close()
        wait_until(
            lambda: any("client left while sending" in r.getMessage() for r in caplog.records), 10, "the 499"
        )
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text
