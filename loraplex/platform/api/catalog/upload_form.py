"""Reading a multipart adapter upload as it arrives: files straight to disk, with a size cap.

``read_upload_form`` feeds the body to python-multipart's streaming parser chunk by chunk; file
parts are written with aiofiles into the staging folder (never buffered whole, never in the
event loop's thread), text fields are kept up to 1 KiB. It refuses, with a 4xx naming the cause:

| what | status / code |
|---|---|
| not ``multipart/form-data``, a broken body, unknown or repeated parts | 400 bad_upload |
| files over ``max_bytes`` together (counted as they arrive) | 413 upload_too_large |
| a body that stops before its closing boundary, or a client that leaves | 400 incomplete_upload |
| a body that sends nothing for ``idle_s``, or takes over ``total_s`` in all | 408 upload_timeout |

Whatever it refuses, the caller removes the staging folder (its files are only ever there).
"""

from __future__ import annotations

import asyncio
import codecs
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiofiles
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from loraplex.adapters.uploads import UploadedFile
from loraplex.platform.api.errors import APIError

FILE_FIELDS = ("file", "adapter_config", "adapter_model")
TEXT_FIELDS = ("name", "visibility")
MAX_TEXT_FIELD_BYTES = 1024


def bad_upload(message: str, code: str = "bad_upload") -> APIError:
    return APIError(400, message, code=code)


@dataclass(frozen=True)
class UploadDeadlines:
    """How long an upload's body may take: between two chunks, and in all."""

    idle_s: float = 30.0
    total_s: float = 600.0


def _timed_out(message: str) -> APIError:
    return APIError(408, message, code="upload_timeout", headers={"Connection": "close"})


async def _chunks(request: Request, deadlines: UploadDeadlines) -> AsyncIterator[bytes]:
    """The body's chunks, refused (408) when one takes over ``idle_s`` or all over ``total_s``:
    a client that sends headers and then nothing holds no staging folder past the deadline."""
    stream = request.stream().__aiter__()
    end_s = time.monotonic() + deadlines.total_s
    while True:
        left_s = end_s - time.monotonic()
        try:
            chunk = await asyncio.wait_for(anext(stream), min(deadlines.idle_s, max(0.0, left_s)))
        except StopAsyncIteration:
            return
        except TimeoutError:
            if left_s <= deadlines.idle_s:
                raise _timed_out(
                    f"The upload took longer than this server's limit of {deadlines.total_s:g} s."
                ) from None
            raise _timed_out(
                f"The upload sent nothing for {deadlines.idle_s:g} s; it was abandoned."
            ) from None
        yield chunk


@dataclass
class UploadForm:
    """The text fields and the files (already on disk) of one upload."""

    fields: dict[str, str] = field(default_factory=dict)
    files: dict[str, UploadedFile] = field(default_factory=dict)


@dataclass
class _Part:
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    name: str = ""
    filename: str | None = None
    data: bytearray = field(default_factory=bytearray)


class _Collector:
    """python-multipart's callbacks (synchronous): they only record what the async loop then does."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.part = _Part()
        self.header_name = b""
        self.header_value = b""
        self.file_chunks: list[tuple[str, bytes]] = []  # (field, data) to write, in order
        self.ended_files: list[str] = []
        self.text: dict[str, str] = {}
        self.file_names: dict[str, str] = {}
        self.num_file_bytes = 0
        self.complete = False

    def callbacks(self) -> Any:
        return {
            "on_part_begin": self.on_part_begin,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_end": self.on_end,
        }

    def on_part_begin(self) -> None:
        self.part = _Part()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def on_header_end(self) -> None:
        self.part.headers.append((self.header_name.lower(), self.header_value))
        self.header_name = self.header_value = b""

    def on_headers_finished(self) -> None:
        disposition = next((v for k, v in self.part.headers if k == b"content-disposition"), b"")
        _, options = parse_options_header(disposition)
        name = _decode(options.get(b"name", b""))
        if b"filename" in options:
            if name not in FILE_FIELDS:
                raise bad_upload(f"Unexpected file part '{name}'; send {' or '.join(FILE_FIELDS)}.")
            if name in self.file_names:
                raise bad_upload(f"The file part '{name}' is sent twice.")
            self.part.filename = _decode(options[b"filename"]) or name
            self.file_names[name] = self.part.filename
        elif name not in TEXT_FIELDS:
            raise bad_upload(f"Unexpected field '{name}'; the fields are {', '.join(TEXT_FIELDS)}.")
        elif name in self.text:
            raise bad_upload(f"The field '{name}' is sent twice.")
        self.part.name = name

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self.part.filename is None:
            if len(self.part.data) + len(chunk) > MAX_TEXT_FIELD_BYTES:
                raise bad_upload(f"The field '{self.part.name}' is longer than {MAX_TEXT_FIELD_BYTES} bytes.")
            self.part.data.extend(chunk)
            return
        self.num_file_bytes += len(chunk)
        if self.num_file_bytes > self.max_bytes:
            raise APIError(
                413,
                f"Request body is larger than the server's limit of {self.max_bytes} bytes.",
                code="upload_too_large",
            )
        self.file_chunks.append((self.part.name, chunk))

    def on_part_end(self) -> None:
        if self.part.filename is None:
            try:
                self.text[self.part.name] = self.part.data.decode("utf-8")
            except UnicodeDecodeError:
                raise bad_upload(f"The field '{self.part.name}' is not UTF-8 text.") from None
        else:
            self.ended_files.append(self.part.name)

    def on_end(self) -> None:
        self.complete = True


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def _boundary(request: Request) -> bytes:
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data" or not params.get(b"boundary"):
        raise bad_upload("Send the adapter as multipart/form-data (fields name, visibility and the files).")
    charset = params.get(b"charset", b"utf-8").decode("latin-1")
    try:
        codecs.lookup(charset)
    except LookupError:
        raise bad_upload(f"Unknown charset {charset!r}.") from None
    return params[b"boundary"]


async def read_upload_form(
    request: Request, staging: Path, max_bytes: int, deadlines: UploadDeadlines | None = None
) -> UploadForm:
    """The upload's fields, with each file part written to ``staging/<field>`` as it arrives."""
    collector = _Collector(max_bytes)
    try:
        parser = MultipartParser(_boundary(request), collector.callbacks())
    except FormParserError as exc:
        raise bad_upload(f"Invalid multipart body: {exc}") from None
    handles: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    try:
        async for chunk in _chunks(request, deadlines or UploadDeadlines()):
            if collector.complete:
                continue  # bytes after the closing boundary (an epilogue) are ignored
            try:
                parser.write(chunk)
            except FormParserError as exc:
                raise bad_upload(f"Invalid multipart body: {exc}") from None
            for name, data in collector.file_chunks:
                if name not in handles:
                    handles[name] = await aiofiles.open(staging / name, "xb")
                await handles[name].write(data)
                sizes[name] = sizes.get(name, 0) + len(data)
            collector.file_chunks.clear()
            for name in collector.ended_files:
                if name not in handles:  # an empty file part
                    handles[name] = await aiofiles.open(staging / name, "xb")
                await handles.pop(name).close()
            collector.ended_files.clear()
    except ClientDisconnect:
        raise bad_upload(
            "The client went away before the upload was complete.", "incomplete_upload"
        ) from None
    finally:
        for handle in handles.values():
            await handle.close()
    if not collector.complete or handles:
        raise bad_upload(
            "The upload ended before its closing multipart boundary (a half-sent body).", "incomplete_upload"
        )
    files = {
        name: UploadedFile(name, filename, staging / name, sizes.get(name, 0))
        for name, filename in collector.file_names.items()
    }
    return UploadForm(fields=collector.text, files=files)
