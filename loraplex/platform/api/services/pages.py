"""Keyset pagination: every list the gateway serves is read one page at a time.

A page is ``limit`` rows after a cursor, in the order of an index, with one row more asked for
to learn ``has_more``. The cursor is the sort key of the last row shown (a tenant's name, a
key's id) or, where that key has several columns or is not public, an opaque token
(``encode_cursor``): urlsafe base64 of the key's values as JSON. A query goes on from the
cursor with ``WHERE key > :cursor ORDER BY key LIMIT n``, which an index answers by seeking,
so page 5,000 costs what page 1 does (OFFSET would read and skip every row before it).

A cursor only says where to go on; every query still has its own filters (the caller's
tenant among them), so a forged or another tenant's cursor can show nothing more than the
list itself would.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from loraplex.platform.api.services.errors import InvalidInput

T = TypeVar("T")
U = TypeVar("U")

DEFAULT_LIMIT = 20
MAX_LIMIT = 100
_MAX_CURSOR_CHARS = 512


@dataclass(frozen=True)
class PageRequest:
    """Which page: at most ``limit`` rows after the cursor ``after`` (None: from the start)."""

    limit: int = DEFAULT_LIMIT
    after: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not 1 <= self.limit <= MAX_LIMIT:
            raise InvalidInput("limit", f"must be from 1 to {MAX_LIMIT}")
        if self.after is not None and not 1 <= len(self.after) <= _MAX_CURSOR_CHARS:
            raise InvalidInput("after", "not a cursor this list gave")


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a list: its rows, each row's cursor, and whether more follow."""

    items: list[T]
    cursors: list[str]
    """``cursors[i]`` continues the list after ``items[i]`` (the answer's ``first_id`` / ``last_id``)."""
    has_more: bool

    @property
    def first_id(self) -> str | None:
        return self.cursors[0] if self.cursors else None

    @property
    def last_id(self) -> str | None:
        return self.cursors[-1] if self.cursors else None

    def map(self, convert: Callable[[T], U]) -> Page[U]:
        """The same page with each row converted (to a response body)."""
        return Page([convert(item) for item in self.items], self.cursors, self.has_more)


def make_page(rows: Sequence[T], page: PageRequest, cursor_of: Callable[[T], str]) -> Page[T]:
    """The page from ``rows``, a query's answer to ``LIMIT page.limit + 1``."""
    shown = list(rows[: page.limit])
    return Page(shown, [cursor_of(row) for row in shown], len(rows) > page.limit)


def encode_cursor(*values: str | int) -> str:
    """An opaque cursor holding a sort key of several values."""
    raw = json.dumps(list(values), separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, types: tuple[type, ...]) -> tuple[str | int, ...]:
    """The values of a cursor from ``encode_cursor``, each of the type given; ``InvalidInput`` else."""
    try:
        values = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError):
        raise InvalidInput("after", "not a cursor this list gave") from None
    if (
        not isinstance(values, list)
        or len(values) != len(types)
        # bool is an int to Python but never a cursor value
        or not all(type(v) is t for v, t in zip(values, types, strict=True))
    ):
        raise InvalidInput("after", "not a cursor this list gave")
    return tuple(values)


def int_cursor(cursor: str) -> int:
    """A cursor that is a row id (a key's id), as shown in listings."""
    if not cursor.isascii() or not cursor.isdigit() or len(cursor) > 19:
        raise InvalidInput("after", "must be the id of a row of this list")
    return int(cursor)
