"""A refused quota admission as the client's answer: 429 for a full limit, 503 while quotas cannot
be checked, with the ``rejected_requests_total`` reason it is counted under."""

from __future__ import annotations

from loraplex.platform.api.errors import SERVER_ERROR, APIError
from loraplex.platform.api.tenancy.quotas.base import QuotaDecision
from loraplex.platform.engine.errors import RejectionReason


def quota_refusal(decision: QuotaDecision) -> APIError:
    """The answer to a refused admission: 429 for a full limit, 503 while quotas cannot be checked."""
    headers = {} if decision.retry_after_header is None else {"Retry-After": decision.retry_after_header}
    if decision.reason == "unavailable":
        return APIError(
            503,
            decision.detail,
            code="quota_unavailable",
            err_type=SERVER_ERROR,
            headers=headers,
            reason="quota_unavailable",
        )
    kind = "tokens" if decision.reason in ("tpm", "request_over_tpm") else "requests"
    reason = _QUOTA_REASONS.get(decision.reason or "", "rate_limit")
    return APIError(
        429, decision.detail, code="rate_limit_exceeded", err_type=kind, headers=headers, reason=reason
    )


_QUOTA_REASONS: dict[str, RejectionReason] = {
    "rpm": "rate_limit",
    "tpm": "token_limit",
    "request_over_tpm": "token_limit",
    "concurrency": "concurrency",
}
"""Quota refusal reason -> the ``rejected_requests_total`` reason."""
