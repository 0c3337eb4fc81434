"""Two ``loraplex serve`` replicas on one PostgreSQL and a private Redis: a change made through A is in
force on B within 2 s (replica events), though B's key checks are cached for far longer; with
Redis stopped, within the cache's TTL (the documented worst case).

| change on A | what B does | with Redis | Redis stopped |
|---|---|---|---|
| a key revoked | 401 for it | < 2 s | <= ``auth_cache_ttl_s`` |
| a tenant disabled | 401 for its keys | < 2 s | <= ``auth_cache_ttl_s`` |
| a quota changed | the new quota (429 at rpm=1; no 503 once unlimited) | < 2 s | <= ``auth_cache_ttl_s`` |

The TTL is 10 s here: B answering within 2 s can only come from the event. Redis is a private
``redis-server`` (``redis_process``) this test kills, never the machine's shared one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from support.redis import RedisProcess
from support.replicas import ADMIN, Replica, start_replica, tenant_key

TTL_S = 10.0
EVENT_BOUND_S = 2.0


@pytest.fixture
def pair(
    tmp_path: Path, tiny_dirs: dict[str, Path], database_url: str, redis_process: RedisProcess
) -> Iterator[tuple[Replica, Replica, RedisProcess]]:
    shared = {
        "LORAPLEX_DATABASE_URL": database_url,
        "LORAPLEX_REDIS_URL": redis_process.url,
        "LORAPLEX_QUOTA_KEY_PREFIX": "lpx-invalidation",
        "LORAPLEX_QUOTA_FAILURE_POLICY": "fail_closed",
        "LORAPLEX_ADAPTER_STORE": str(tmp_path / "shared-adapters"),
        "LORAPLEX_AUTH_CACHE_TTL_S": str(TTL_S),
    }
    a = start_replica("a", tmp_path, tiny_dirs["gqa_tied"], shared)
    b = start_replica("b", tmp_path, tiny_dirs["gqa_tied"], shared)
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b, redis_process
    finally:
        a.stop()
        b.stop()


def call(replica: Replica, key: str) -> int:
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 1, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"}
    return replica.client.post("/v1/completions", json=body, headers=headers).status_code


def seconds_until(check: Callable[[], bool], limit_s: float) -> float:
    """How long until ``check()`` holds, polling; fails past ``limit_s``."""
    start = time.monotonic()
    while not check():
        elapsed = time.monotonic() - start
        assert elapsed < limit_s, f"not in force after {elapsed:.1f} s (limit {limit_s} s)"
        time.sleep(0.05)
    return time.monotonic() - start


def patch(replica: Replica, tenant: str, **body: object) -> None:
    r = replica.client.patch(f"/admin/api/tenants/{tenant}", json=body, headers=ADMIN)
    assert r.status_code == 200, r.text


def revoke(replica: Replica, key_id: int) -> None:
    assert replica.client.delete(f"/admin/api/keys/{key_id}", headers=ADMIN).status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_changes_through_a_are_in_force_on_b_within_2s_and_within_the_ttl_without_redis(
    pair: tuple[Replica, Replica, RedisProcess],
) -> None:
    a, b, redis = pair
    keys = {name: tenant_key(a, name) for name in ("revoked", "switched", "metered", "revoked2", "switched2")}
    limited, _ = tenant_key(a, "limited", rpm=1000)
    for key, _ in keys.values():
        assert call(b, key) == 200  # B caches each key's check (with the tenant row it read)
    assert call(b, limited) == 200

    # With Redis: each change is in force on B within 2 s, long before its cached check expires.
    revoke(a, keys["revoked"][1])
    took = seconds_until(lambda: call(b, keys["revoked"][0]) == 401, EVENT_BOUND_S)
    patch(a, "switched", disabled=True)
    took = max(took, seconds_until(lambda: call(b, keys["switched"][0]) == 401, EVENT_BOUND_S))
    patch(a, "metered", rpm=1)
    took = max(took, seconds_until(lambda: call(b, keys["metered"][0]) == 429, EVENT_BOUND_S))
    print(f"slowest change in force on B with Redis: {took:.2f} s")

    # Without Redis: no event travels; each change is in force once B's cached check expires.
    redis.kill()
    assert call(b, limited) == 503  # fail_closed: a limited tenant cannot be counted now
    started = time.monotonic()
    revoke(a, keys["revoked2"][1])
    patch(a, "switched2", disabled=True)
    patch(a, "limited", rpm=None)  # unlimited: needs no Redis, once B knows
    assert call(b, keys["revoked2"][0]) == 200, "B heard of a change with Redis down: the test proves nothing"
    for check in (
        lambda: call(b, keys["revoked2"][0]) == 401,
        lambda: call(b, keys["switched2"][0]) == 401,
        lambda: call(b, limited) == 200,
    ):
        seconds_until(check, TTL_S + 5.0 - (time.monotonic() - started))
    elapsed = time.monotonic() - started
    print(f"every change in force on B without Redis after {elapsed:.2f} s (TTL {TTL_S} s)")
    assert elapsed > EVENT_BOUND_S  # it took the TTL, not an event
    with httpx.Client(base_url=str(a.client.base_url)) as client:
        assert client.get("/health").status_code == 200  # A served through the outage too


@pytest.mark.slow
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_changes_through_the_cli_are_in_force_on_a_running_replica_within_2s(
    pair: tuple[Replica, Replica, RedisProcess],
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``loraplex keys revoke`` / ``tenants disable`` / ``tenants update`` talk to the database, and
    through Redis to the running replicas, which drop their cached checks at once (not at the TTL)."""
    from loraplex.cli import main

    a, _, redis = pair
    keys = {name: tenant_key(a, name) for name in ("cli-revoked", "cli-switched", "cli-metered")}
    for key, _ in keys.values():
        assert call(a, key) == 200  # A caches each key's check
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", database_url)
    monkeypatch.setenv("LORAPLEX_REDIS_URL", redis.url)
    monkeypatch.setenv("LORAPLEX_QUOTA_KEY_PREFIX", "lpx-invalidation")

    def cli(*argv: str) -> None:
        assert main(list(argv)) == 0, capsys.readouterr().err

    cli("keys", "revoke", str(keys["cli-revoked"][1]))
    took = seconds_until(lambda: call(a, keys["cli-revoked"][0]) == 401, EVENT_BOUND_S)
    cli("tenants", "disable", "cli-switched")
    took = max(took, seconds_until(lambda: call(a, keys["cli-switched"][0]) == 401, EVENT_BOUND_S))
    cli("tenants", "update", "cli-metered", "--rpm", "1")
    took = max(took, seconds_until(lambda: call(a, keys["cli-metered"][0]) == 429, EVENT_BOUND_S))
    print(f"slowest CLI change in force on the replica: {took:.2f} s")
