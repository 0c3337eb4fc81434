"""Schemathesis over the app's own OpenAPI schema: no 5xx, no response outside the schema.

A real server on loopback (the tiny LoRA-enabled engine, a SQLite gateway in keys mode) and a
real tenant key; admin operations carry the admin token. Examples are bounded per operation
(``MAX_EXAMPLES``) so the run stays under a minute or two on a loaded 2-core machine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance
from support.gateway import ADMIN, settings_for
from support.ports import free_port

from loraplex.platform.api.app import build_app
from loraplex.platform.api.server import Server
from loraplex.platform.engine.async_engine import AsyncEngine

MAX_EXAMPLES = 10


@pytest.fixture(scope="module")
def live_gateway(
    gateway_engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """(base URL, a tenant's API key) of a gateway served on a real port."""
    tmp = tmp_path_factory.mktemp("fuzz")
    # The schema is off by default in keys mode (api_docs); the fuzzer reads it, so it is on here.
    app = build_app(gateway_engine, settings_for(tmp, f"sqlite+aiosqlite:///{tmp / 'g.db'}", api_docs=True))
    port = free_port()
    server = Server(app, "127.0.0.1", port, log_level="warning")
    # The engine is the module's fixture: the server must not shut it down when it stops.
    server.uvicorn._after_shutdown = lambda: None
    thread = threading.Thread(target=server.uvicorn.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    created = httpx.post(f"{url}/admin/api/tenants", json={"name": "fuzz"}, headers=ADMIN, timeout=30)
    assert created.status_code == 201, created.text
    key = httpx.post(f"{url}/admin/api/tenants/fuzz/keys", json={}, headers=ADMIN, timeout=30)
    assert key.status_code == 201, key.text
    try:
        yield url, str(key.json()["key"])
    finally:
        server.stop()
        thread.join(60)


@pytest.fixture(scope="module")
def api_schema(live_gateway: tuple[str, str]) -> schemathesis.BaseSchema:
    url, _ = live_gateway
    return schemathesis.openapi.from_url(f"{url}/openapi.json")


def _call(case: schemathesis.Case, url: str, key: str) -> None:
    """Send one generated case, as the tenant (the admin for admin operations), and check it."""
    if case.path == "/admin/api/tenants/{name}" and case.method.upper() == "DELETE":
        case.path_parameters = {**(case.path_parameters or {}), "name": "someone-else"}  # keep ours
    auth = ADMIN if case.path.startswith("/admin") else {"Authorization": f"Bearer {key}"}
    case.call_and_validate(
        base_url=url, headers=auth, checks=[not_a_server_error, response_schema_conformance], timeout=120
    )


@pytest.mark.slow
def test_no_server_error_and_no_response_outside_the_schema(
    api_schema: schemathesis.BaseSchema, live_gateway: tuple[str, str]
) -> None:
    # Driven by hand (hypothesis per operation) rather than by schemathesis' pytest plugin,
    # whose fixture-based parametrization does not run under this pytest.
    url, key = live_gateway
    failures: dict[str, str] = {}
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 10
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            phases=[Phase.explicit, Phase.generate],
        )
        def run(case: schemathesis.Case) -> None:
            _call(case, url, key)

        try:
            run()
        except Exception as exc:  # every operation runs; the failures are listed together
            failures[operation.label] = f"{type(exc).__name__}: {exc}"[:2000]
    assert not failures, "\n\n".join(f"{label}\n{text}" for label, text in failures.items())


def test_the_schema_lists_the_operators_endpoints(api_schema: schemathesis.BaseSchema) -> None:
    paths = set(api_schema.raw_schema["paths"])
    assert {"/v1/completions", "/v1/chat/completions", "/health", "/ready", "/metrics"} <= paths
