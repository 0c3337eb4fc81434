"""The engine's unfinished requests, and the one way each of them ends.

A request ends in one of four ways: it finishes (the output processor), it fails (an error
while planning or running it), it passes its deadline, or the scheduler rejects it while
planning (its adapter was removed). Every one goes through ``RequestBook.retire``, so a
request is forgotten and counted for its tenant exactly once, whatever ended it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from loraplex.platform.engine.counters import RejectionCounters, TenantCounters
from loraplex.platform.engine.deadlines import Deadlines
from loraplex.platform.engine.errors import EngineDeadError, ErrorKind, RequestError
from loraplex.platform.engine.output_processor import request_output
from loraplex.platform.engine.outputs import RequestOutput
from loraplex.platform.engine.scheduler import Scheduler
from loraplex.platform.engine.scheduler_output import SchedulerOutput
from loraplex.platform.engine.sequence import Request

logger = logging.getLogger(__name__)


class RequestBook:
    """Who is unfinished (``requests``), their deadlines, and the per-tenant counters."""

    def __init__(self, scheduler: Scheduler, check_integrity: Callable[[], None]) -> None:
        self._scheduler = scheduler
        self._check_integrity = check_integrity
        self.requests: dict[str, Request] = {}
        """Every unfinished request by id (waiting, running, or swapped out)."""
        self.deadlines = Deadlines()
        self.usage = TenantCounters()
        """Tokens and requests per tenant (prompt, generated, cached, failed)."""
        self.rejections = RejectionCounters()
        """Requests refused or ended by reason (``overload``, ``deadline``); any thread may count."""

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def __len__(self) -> int:
        return len(self.requests)

    def open(self, req: Request, timeout_s: float | None) -> None:
        """Book ``req`` (validated, its first sequence made) and hand that sequence to the scheduler."""
        if timeout_s is not None:
            req.deadline = req.arrival_time + timeout_s
            self.deadlines.add(req)
        self.requests[req.request_id] = req
        self.usage.added(req.tenant_id, len(req.prompt_token_ids))
        self._scheduler.add(req.seqs[0])

    def retire(self, req: Request) -> None:
        """``req`` has ended: forget it, and count it once for its tenant."""
        if self.requests.pop(req.request_id, None) is not None:
            self.usage.finished(req.tenant_id, req.num_cached_tokens, req.error is not None)

    def abort(self, req: Request) -> None:
        """End ``req`` now, with no error (the caller's abort): free its blocks and adapter pin."""
        self._scheduler.abort(req.seqs)
        req.forked = True  # no siblings will be forked now
        self.retire(req)

    def fail(self, req: Request, error: RequestError) -> RequestOutput:
        """Finish ``req`` as aborted with ``error``; free its blocks and adapter pin."""
        req.error = error
        self.abort(req)
        return request_output(req)

    def fail_checked(
        self, reqs: Iterable[Request], error: RequestError, exc: Exception
    ) -> list[RequestOutput]:
        """Fail ``reqs`` after ``exc`` (a step or a plan that raised), then check that the engine's
        state still holds together: ``EngineDeadError`` when it does not (nothing can be served)."""
        failed = [self.fail(req, error) for req in reqs]
        try:
            self._check_integrity()
        except AssertionError as bad:
            raise EngineDeadError(f"engine state is inconsistent after a failure: {bad}") from exc
        return failed

    def expire(self, now: float | None = None) -> list[RequestOutput]:
        """End the requests past their deadline (``request_timeout_s``), freeing their blocks."""
        outputs = []
        for request_id, deadline in self.deadlines.expired(time.monotonic() if now is None else now):
            req = self.requests.get(request_id)
            if req is None or req.deadline != deadline:
                continue  # finished before its deadline (the id may be in use again)
            timeout_s = deadline - req.arrival_time
            state = "running" if any(s.num_computed_tokens for s in req.seqs) else "waiting"
            logger.info("request %s passed its %.3g s deadline (%s)", req.request_id, timeout_s, state)
            self.rejections.count("deadline")
            error = RequestError(
                ErrorKind.DEADLINE,
                f"The request did not finish within its deadline of {timeout_s:g} s "
                f"(request_timeout_s); it was {state} when it ended.",
            )
            outputs.append(self.fail(req, error))
        return outputs

    def take_rejected(self, out: SchedulerOutput) -> list[RequestOutput]:
        """Requests the scheduler ended while planning: rejected (their adapter was removed) or
        failed (an error planning them); ``request.error`` says which."""
        outputs = []
        for seq in out.aborted:
            req = seq.request
            req.forked = True  # no siblings will ever be forked now
            if req.request_id in self.requests:
                self.abort(req)
                outputs.append(request_output(req))
        return outputs
