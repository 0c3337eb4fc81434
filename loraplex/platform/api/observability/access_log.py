"""Access logs: one JSON line per request on the ``loraplex.access`` logger.

    {"ts": "2026-12-03T01:02:03.456Z", "method": "POST", "path": "/v1/completions", "status": 200,
     "tenant": "acme", "model": "acme-fr", "adapter": "acme-fr", "stream": true,
     "prompt_tokens": 12, "cached_tokens": 0, "generated_tokens": 16,
     "ttft_s": 0.041, "latency_s": 0.385, "error": null}

``status`` is what the client was told (a stream's error event counts: its status, with the
error's ``code`` in ``error``). Prompt text is never logged unless ``access_log_prompts`` asks
for it (then ``prompts``: the prompt strings, or token-id lists, as submitted). Probes
(``/health``, ``/ready``, ``/metrics``) are not logged. ``loraplex serve`` prints these lines
bare on stderr (no prefix), so a log collector can parse each line as JSON.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from loraplex.platform.api.observability.record import RequestRecord
from loraplex.platform.api.tenancy.tenant_gate import tokens_used

ACCESS_LOGGER = "loraplex.access"
logger = logging.getLogger(ACCESS_LOGGER)


def access_entry(record: RequestRecord, with_prompts: bool = False) -> dict[str, Any]:
    """The fields of one access-log line."""
    prompt, cached, generated = tokens_used([s.last for s in record.streams])
    ttft = record.ttft_s
    now = time.time()
    entry: dict[str, Any] = {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z",
        "method": record.method,
        "path": record.path,
        "status": record.effective_status,
        "tenant": record.tenant,
        "model": record.model,
        "adapter": record.adapter,
        "stream": record.stream,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "generated_tokens": generated,
        "ttft_s": None if ttft is None else round(ttft, 6),
        "latency_s": round(record.latency_s, 6),
        "error": None if record.error is None else (record.error.code or record.error.err_type),
    }
    if with_prompts and record.prompts is not None:
        entry["prompts"] = list(record.prompts)
    return entry


def log_access(record: RequestRecord, with_prompts: bool = False) -> None:
    """Write the request's line (at INFO)."""
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s", json.dumps(access_entry(record, with_prompts), ensure_ascii=False))
