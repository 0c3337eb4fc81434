"""Adapter identity: who named it, who owns it, and which exact weights it is.

The version is a sha256 over the adapter's *content*, so a re-upload under the same
name with other weights is a different version (the prefix cache keys KV on it and
never reuses stale blocks), and the same files uploaded twice are the same version::

    version = sha256( b"loraplex-adapter-v1\\0"
                      || u64be(len(C)) || C      C = canonical JSON of adapter_config.json
                      || u64be(len(W)) || W )    W = adapter_model.safetensors, raw bytes

Canonical JSON (sorted keys, no whitespace) makes the hash independent of how the
config file was formatted; the length prefixes keep the two parts from sliding into
each other.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

_DOMAIN = b"loraplex-adapter-v1\x00"


def content_version(config: dict[str, object], weights: bytes) -> str:
    """sha256 hex digest of an adapter's parsed config and raw safetensors bytes."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    digest = hashlib.sha256(_DOMAIN)
    for part in (canonical, weights):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


@dataclass(frozen=True)
class AdapterIdentity:
    """Name, owner and content version of a registered adapter.

    ``cache_key`` is what the KV prefix cache mixes into its block hashes: the id
    *and* the version, so a new version under an old id never hits old blocks.
    """

    adapter_id: int
    name: str
    owner: str | None
    version: str  # sha256 hex of config + weights
    served_name: str | None = field(default=None, compare=False)
    """What clients put in ``model`` for it when that is not ``name`` (a gateway registers each
    version under a unique engine name); metrics and KV events name the adapter so."""

    @property
    def cache_key(self) -> tuple[int, str]:
        return (self.adapter_id, self.version)

    @property
    def display_name(self) -> str:
        """The name routers and dashboards see: ``served_name``, else ``name``."""
        return self.served_name or self.name
