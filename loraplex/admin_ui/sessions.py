"""Sign-in sessions of the admin web UI, and the limit on failed sign-ins.

A session is a random 256-bit token in an HttpOnly cookie; the server keeps only its sha256,
with who signed in (the operator, or a tenant through one of its keys), its CSRF token and its
expiry. Signing out deletes it here, so a copied cookie stops working at once (server-side
revocation), and a tenant's session also ends as soon as the key it signed in with stops
authenticating (revoked, expired, tenant disabled: checked on every request, ``security``).

Sessions live in this process: a server with several replicas needs sticky sessions for the UI
(or one replica serving ``/admin``); a restart signs everyone out.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

Role = Literal["operator", "tenant"]

MAX_SESSIONS = 10_000
"""Sessions held at once; the oldest go first beyond it (sign-ins cannot grow memory unbounded)."""


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class AdminSession:
    """One signed-in browser."""

    role: Role
    tenant: str | None
    """The tenant's name for a tenant session (None for the operator)."""
    key_id: int | None
    """The key a tenant signed in with: the session lasts while it authenticates."""
    csrf_token: str
    expires_at: float
    """``time.time()`` after which the session is gone."""


class SessionStore:
    """The live sessions, by the sha256 of their cookie token."""

    def __init__(self, ttl_s: float, max_sessions: int = MAX_SESSIONS) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._sessions: dict[str, AdminSession] = {}

    def create(
        self, role: Role, tenant: str | None = None, key_id: int | None = None
    ) -> tuple[str, AdminSession]:
        """A new session: (the cookie's token, shown only to the browser; the session)."""
        now = time.time()
        self._sweep(now)
        token = secrets.token_urlsafe(32)
        session = AdminSession(role, tenant, key_id, secrets.token_urlsafe(32), now + self.ttl_s)
        self._sessions[_digest(token)] = session
        return token, session

    def get(self, token: str | None) -> AdminSession | None:
        """The live session of a cookie token, or None (unknown, signed out, expired)."""
        if not token or len(token) > 128:
            return None
        digest = _digest(token)
        session = self._sessions.get(digest)
        if session is None:
            return None
        if session.expires_at <= time.time():
            del self._sessions[digest]
            return None
        return session

    def revoke(self, token: str | None) -> None:
        """End a session (sign-out); unknown tokens are ignored."""
        if token:
            self._sessions.pop(_digest(token), None)

    def revoke_tenant(self, tenant: str) -> int:
        """End every session of ``tenant`` (it was deleted); returns how many."""
        doomed = [d for d, s in self._sessions.items() if s.tenant == tenant]
        for digest in doomed:
            del self._sessions[digest]
        return len(doomed)

    def __len__(self) -> int:
        return len(self._sessions)

    def _sweep(self, now: float) -> None:
        for digest in [d for d, s in self._sessions.items() if s.expires_at <= now]:
            del self._sessions[digest]
        while len(self._sessions) >= self.max_sessions:  # dicts keep insertion order: oldest first
            del self._sessions[next(iter(self._sessions))]


class SignInLimiter:
    """At most ``max_failures`` failed sign-ins per client address per ``window_s``.

    Counted per address so one client guessing keys cannot lock everyone else out; the
    addresses tracked are capped (the oldest forgotten first).
    """

    def __init__(self, max_failures: int, window_s: float = 60.0, max_clients: int = 100_000) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self.max_clients = max_clients
        self._failures: dict[str, deque[float]] = {}

    def retry_after(self, client: str) -> float:
        """Seconds ``client`` must wait before it may try again; 0 when it may now."""
        failures = self._recent(client, time.monotonic())
        if failures is None or len(failures) < self.max_failures:
            return 0.0
        return max(0.0, failures[0] + self.window_s - time.monotonic())

    def failed(self, client: str) -> None:
        now = time.monotonic()
        failures = self._recent(client, now)
        if failures is None:
            if len(self._failures) >= self.max_clients:
                del self._failures[next(iter(self._failures))]
            failures = self._failures[client] = deque()
        failures.append(now)

    def succeeded(self, client: str) -> None:
        self._failures.pop(client, None)

    def _recent(self, client: str, now: float) -> deque[float] | None:
        failures = self._failures.get(client)
        if failures is not None:
            while failures and failures[0] <= now - self.window_s:
                failures.popleft()
        return failures
