"""The sections of the server's settings, other than the engine's (``EngineConfig``).

| section | class | what |
|---|---|---|
| ``serving`` | ``ServingSettings`` | the process: address, port, served model name, tenancy, logs |
| ``engine`` | ``EngineConfig`` (``platform.engine.config``) | the model and the engine (vLLM's names) |
| ``limits`` | ``ServerLimits`` | what one HTTP request may ask for |
| ``gateway`` | ``GatewaySettings`` | tenants: the database, Redis, the adapter store, auth, quotas |
| ``process`` | ``ProcessSettings`` | process-wide switches: the cache folder, the CPU kernels, AMX, malloc |

Each field has a docstring: it becomes the flag's help, and ``--print-settings`` and
``docs/operations.md`` describe the setting with it.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from loraplex.paths import default_cache_root
from loraplex.platform.settings.fields import ENV_PREFIX

AuthMode = Literal["keys", "open"]
FailurePolicy = Literal["fail_closed", "fail_open"]
LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]

MIN_ADMIN_TOKEN_CHARS = 16
_PLACEHOLDER_TOKENS = frozenset({"changeme", "changethis", "admin", "secret", "password", "token", "test"})


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/loraplex``, else ``~/.local/share/loraplex``: state that must survive restarts
    (the gateway's database and adapter store), unlike ``loraplex.paths.cache_root``."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "loraplex"


class ServingSettings(BaseModel):
    """The server process: where it listens and how it presents the model."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    """Address the server binds."""
    port: int = Field(default=8000, ge=0, le=65535)
    """Port the server binds."""
    served_model_name: str | None = None
    """Model id clients send; default: the model folder's (or GGUF file's) name."""
    single_tenant: bool = False
    """The OpenAI-compatible server without tenants, keys, quotas or a database (needed for
    lora_modules)."""
    lora_modules: list[str] = Field(default_factory=list)
    """Adapters to serve in single-tenant mode, as NAME=PATH: clients select one with model=NAME."""
    log_level: LogLevel = "info"
    """Log level of the server."""
    access_log: bool = True
    """One JSON line per request on stderr (logger loraplex.access): tenant, adapter, status,
    tokens, time to first token, latency."""
    access_log_prompts: bool = False
    """Also log each request's prompts in its access-log line (they may hold personal data)."""
    metrics_require_admin: bool | None = None
    """GET /metrics on the serving port needs the admin token; default: yes with auth=keys (its
    series name tenants), no in open and single-tenant mode. Routers and Prometheus scrape
    metrics_port instead."""
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    """A second port, on the same host, that serves only GET /metrics and without auth: for routers'
    endpoint pickers and Prometheus inside the cluster (keep it off the network clients reach);
    unset: no such listener."""
    trusted_proxies: list[str] = Field(default_factory=list)
    """Addresses (or CIDR ranges) of proxies whose X-Forwarded-For / X-Forwarded-Proto are believed
    (the client address of the sign-in limiter and the access log); empty: none, the socket's peer is
    the client. Set it to your ingress's addresses when one sits in front."""
    max_connections: int = Field(default=4096, ge=1)
    """Open client connections of this process; at the limit a new one evicts the oldest that has no
    request running (slow headers, idle keep-alive), else is refused with 503 at once. Kept under the
    open-files limit (raised to its hard limit at start) less the backlog and a reserve of 256."""
    backlog: int = Field(default=2048, ge=1)
    """The listening socket's queue of connections not yet accepted (uvicorn's backlog); the event
    loop may accept this many at once before max_connections sees them, so it counts against the
    open-files limit too."""
    header_timeout_s: float = Field(default=10.0, gt=0)
    """A connection (or a keep-alive connection's next request) must send its whole headers within
    this; past it the connection is closed (slowloris)."""
    body_idle_timeout_s: float = Field(default=30.0, gt=0)
    """A request body that sends nothing for this long is cut (the request ends as 499)."""
    timeout_keep_alive_s: float = Field(default=5.0, gt=0)
    """An idle keep-alive connection is closed after this (uvicorn's timeout_keep_alive)."""
    metrics_tenant_label: bool = True
    """Label the per-tenant metrics with the tenant's name; turn off with many tenants (one series
    per tenant and status otherwise)."""
    metrics_max_tenants: int = Field(default=200, ge=0)
    """At most this many tenants get series of their own; the rest are counted under
    tenant="(other)". A deleted tenant's series are removed, freeing its place."""

    @field_validator("lora_modules", "trusted_proxies", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        # From the environment: one string, entries separated by spaces or commas.
        if isinstance(value, str):
            return value.replace(",", " ").split()
        return value


class GatewaySettings(BaseModel):
    """The multi-tenant gateway: its database, quotas, adapter store and who may call."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", use_attribute_docstrings=True, hide_input_in_errors=True
    )

    data_dir: Path = Field(default_factory=default_data_dir)
    """Where the default database and adapter store live."""
    database_url: str | None = None
    """SQLAlchemy URL of the metadata database (sqlite+aiosqlite:///... or postgresql+asyncpg://...);
    default: the SQLite file gateway.db in data_dir."""
    redis_url: str | None = None
    """Redis shared by every replica for quotas; unset: an in-process limiter (one replica)."""
    admin_token: SecretStr | None = None
    """Bearer token of the admin API (/admin/api); required on a non-loopback host."""
    adapter_store: Path | None = None
    """Folder of the content-addressed adapter store; default: data_dir/adapters."""
    auth: AuthMode = "keys"
    """keys: every /v1 call needs a tenant's API key; open: calls run as the built-in tenant
    'local' (loopback hosts only)."""
    quota_failure_policy: FailurePolicy = "fail_closed"
    """When Redis is unreachable: refuse limited requests (503), or admit them uncounted."""
    quota_window_s: float = Field(default=60.0, gt=0)
    """Length of the rpm / tpm sliding window in seconds."""
    quota_key_prefix: str = "lpx"
    """Prefix of the quota keys in Redis (several deployments can share one Redis)."""
    max_upload_bytes: int | None = Field(default=None, ge=1024)
    """Largest adapter upload (all files of one request together); default: the largest adapter
    the engine accepts (base model and max_lora_rank) plus its config."""
    max_uploads_per_tenant: int = Field(default=2, ge=1)
    """Uploads of one tenant in flight at once in this process (more: 429); uploads also count
    against the tenant's rpm and max_concurrency."""
    max_sequences_per_tenant: int | None = Field(default=None, ge=1)
    """Sequences one tenant may have in flight in this process (each request counts n per prompt);
    more: 429. Unset: bounded only by max_queued_requests and the tenant's max_concurrency (which
    counts sequences too)."""
    upload_workers: int = Field(default=2, ge=1)
    """Threads that validate uploads (extraction, parsing); uploads beyond them wait, so they never
    take the threads that tokenize and render requests."""
    upload_idle_timeout_s: float = Field(default=30.0, gt=0)
    """An upload whose body sends nothing for this long is refused (408) and its files removed."""
    upload_timeout_s: float = Field(default=600.0, gt=0)
    """Longest time an upload's body may take to arrive, however steadily (408 past it)."""
    database_connect_timeout_s: float = Field(default=5.0, gt=0)
    """PostgreSQL: longest wait to open a connection, or for a pooled one to come free."""
    database_statement_timeout_s: float = Field(default=10.0, gt=0)
    """PostgreSQL: longest wait for one statement (client side, and the server's statement_timeout)."""
    database_pool_size: int = Field(default=10, ge=1)
    """PostgreSQL: connections kept open per replica."""
    database_max_overflow: int = Field(default=10, ge=0)
    """PostgreSQL: connections opened beyond database_pool_size under load, closed when returned."""
    database_pool_pre_ping: bool = True
    """PostgreSQL: check a pooled connection before use (one that died with a restart is replaced)."""
    auth_cache_ttl_s: float = Field(default=60.0, ge=0)
    """How long an API key's check (tenant, quotas, status) is reused without the database: the
    bound on how late a revocation, expiry, deletion or disabling reaches each replica."""
    auth_cache_stale_s: float = Field(default=300.0, ge=0)
    """While the database is unreachable, how long past auth_cache_ttl_s a cached key check (or
    adapter resolution) still serves; then such requests get 503 too."""
    auth_cache_size: int = Field(default=100_000, ge=1)
    """Most API keys (and adapter resolutions) cached per replica; the least recently used go."""
    usage_buffer_size: int = Field(default=100_000, ge=1)
    """Most usage records held in memory while the database is unreachable; beyond it they are
    counted as dropped and logged."""
    admin_session_ttl_s: float = Field(default=8 * 3600.0, gt=0)
    """How long an admin web UI sign-in lasts (seconds); signing out ends it at once."""
    admin_signin_max_failures: int = Field(default=5, ge=1)
    """Failed admin web UI sign-ins one client address may make per minute before it must wait."""

    operator_tenant: str = "operator"
    """Tenant that owns the adapters the operator loads with /v1/load_lora_adapter: they are public,
    and every tenant names them by their bare name (its own adapter of that name comes first) or
    as operator_tenant/name."""
    lora_load_root: Path | None = None
    """Server folder under which /v1/load_lora_adapter may read lora_path (a path that resolves
    outside it is refused); unset: only versions already in the adapter store (a 64-hex sha256)."""

    api_docs: bool | None = None
    """Serve /docs and /openapi.json (they list every route, the admin API's too); default: on
    in open mode, off with auth=keys."""

    @property
    def api_docs_on(self) -> bool:
        """``api_docs``, or its default for the auth mode."""
        return self.api_docs if self.api_docs is not None else self.auth == "open"

    @field_validator("admin_token")
    @classmethod
    def _real_secret(cls, token: SecretStr | None) -> SecretStr | None:
        if token is None:
            return None
        value = token.get_secret_value()
        if value.strip().lower() in _PLACEHOLDER_TOKENS or len(value) < MIN_ADMIN_TOKEN_CHARS:
            raise ValueError(
                f"admin_token must be a real secret of at least {MIN_ADMIN_TOKEN_CHARS} characters, not a "
                'placeholder; generate one with: python -c "import secrets; print(secrets.token_urlsafe(32))"'
            )
        return token

    @property
    def database_url_or_default(self) -> str:
        """``database_url``, or the SQLite file ``gateway.db`` in ``data_dir``."""
        return self.database_url or f"sqlite+aiosqlite:///{self.data_dir / 'gateway.db'}"

    @property
    def adapter_store_dir(self) -> Path:
        """``adapter_store``, or ``data_dir/adapters``."""
        return self.adapter_store or self.data_dir / "adapters"


class ProcessSettings(BaseModel):
    """Process-wide switches of the machine the server runs on: the cache, the CPU kernels, malloc.

    Their users sit below the platform (``loraplex.paths``, ``loraplex.kernels.cpu``, whose AMX
    probe is C) or are process-wide (``platform.engine.host_memory``), and read their switch from
    the environment as ``LORAPLEX_<NAME>``, the same names as these settings. The environment is
    the one channel from here to them, so the layers stay one-way: ``apply`` writes the effective
    values there (``loraplex serve`` and the operators' commands call it before the engine or the
    model loader runs), so a flag or a config-file key reaches them as the variable does. Outside
    the server (the offline ``LLM``, benchmarks) the variables are read as they are.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    cache: Path = Field(default_factory=default_cache_root)
    """Folder for what loraplex derives on this machine and rebuilds on demand (GGUF models
    de-quantised to safetensors, the compiled CPU kernels); safe to delete; default:
    ~/.cache/loraplex."""
    cpu_kernels: bool = True
    """Build the C kernels of the CPU path with the system compiler (CC, else cc) on first use and
    run them; off: the pure-torch path (slower, same tokens)."""
    amx: bool = True
    """Run a quantized base's steps of many rows on AMX where the CPU (Intel Xeon since Sapphire
    Rapids) and the OS allow it; off: the AVX-512 / AVX2 kernels run them."""
    malloc_tuning: bool = True
    """On the CPU, raise glibc's mmap and trim thresholds to 1 GiB so freed activations are reused
    instead of page-faulted in again (process-wide; the process keeps up to 1 GiB of freed heap);
    off: leave malloc alone."""

    @field_validator("cpu_kernels", "amx", "malloc_tuning", mode="before")
    @classmethod
    def _strip(cls, value: object) -> object:
        # The layers below read " off " as off; so does the setting.
        return value.strip() if isinstance(value, str) else value

    def environ(self) -> dict[str, str]:
        """These settings as the variables their users read: ``LORAPLEX_<NAME>``, "1" / "0" for a switch."""
        out: dict[str, str] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            out[ENV_PREFIX + name.upper()] = (
                ("1" if value else "0") if isinstance(value, bool) else str(value)
            )
        return out

    def apply(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Export ``environ()`` into ``environ`` (default: ``os.environ``, which the C code's ``getenv``
        sees too). Call it before the engine is built: the kernels and malloc read it once."""
        (os.environ if environ is None else environ).update(self.environ())


_ZERO_ALLOWED = (
    "max_completion_logprobs",
    "max_top_logprobs",
    "graceful_shutdown_s",
    "request_timeout_s",
    "stream_write_timeout_s",
)
"""A logprobs cap of 0 still returns the sampled token's own logprob; 0 s means no grace (no
deadline, for request_timeout_s)."""


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits of the OpenAI-compatible server (HTTP 413 / 400 when exceeded).

    The defaults are meant to be kept by a public deployment: they bound the work a single
    request can make the server do before the engine sees it (reading, parsing and
    tokenizing the body) and the size of what it asks the engine for. Limits the engine
    derives from its own configuration (context length, ``max_num_seqs``, the KV pool) are
    checked by the engine, not here.
    """

    max_request_body_bytes: int = 8 * 1024 * 1024
    """Largest request body in bytes; larger bodies get 413 before they are read in full."""
    max_prompt_chars: int = 1_000_000
    """Most characters of prompt text per request (all prompts, or all chat messages),
    checked before tokenization; token-id prompts are bounded by the context length."""
    max_chat_messages: int = 1024
    """Most messages in one chat request, checked right after the JSON is parsed (before validating,
    templating or tokenizing any of them)."""
    max_stop_strings: int = 16
    """Most entries in stop."""
    max_stop_string_chars: int = 256
    """Longest single stop string, in characters."""
    max_stop_token_ids: int = 64
    """Most entries in stop_token_ids."""
    max_n: int = 16
    """Most completions per request: n times the number of prompts."""
    max_completion_logprobs: int = 5
    """Largest logprobs on /v1/completions (OpenAI's cap is 5)."""
    max_top_logprobs: int = 20
    """Largest top_logprobs on /v1/chat/completions (OpenAI's cap is 20)."""
    graceful_shutdown_s: int = 10
    """On SIGTERM/SIGINT, how long open requests may run before they are cancelled."""
    # Overload control (fair share and queue bounds: engine/policy.py, docs/operations.md).
    max_queued_requests: int = 512
    """Most requests waiting in the engine's queue; past it a request is refused at once with 503,
    Retry-After and nothing queued (the offline LLM API has no bound)."""
    request_timeout_s: int = 600
    """Deadline of each request in seconds, waiting and running together: past it the request
    ends with an error (408, request_timeout) and frees its KV blocks; 0 = no deadline."""
    # Hostile clients (docs/operations.md, "Hostile tenants").
    max_response_logprobs: int = 262_144
    """Most logprob entries a whole (non-streamed) answer may hold: n x prompts x max_tokens x
    (1 + top logprobs), refused up front with 400 when over (about 15 MB of JSON); streamed answers
    are sent as they come and are not capped."""
    stream_write_timeout_s: int = 30
    """How long one write of a streamed answer may wait for a client that stopped reading; past it
    the request is aborted and its slot, KV blocks and adapter pin freed (usage still recorded);
    0 = wait forever."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            lowest = 0 if f.name in _ZERO_ALLOWED else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                raise ValueError(f"{f.name} must be an integer >= {lowest}, got {value!r}")
        if self.max_request_body_bytes < 1024:
            raise ValueError(
                "max_request_body_bytes must be >= 1024 (a minimal request), "
                f"got {self.max_request_body_bytes}"
            )
