"""Fuzzing the upload parser: whatever the bytes, a typed refusal (or a valid adapter), in bounded time.

Hypothesis builds archives (.zip, .tar in every compression, and mutations of a valid one) and
two-file uploads (any config JSON, any weights bytes) and runs ``AdapterValidator.validate`` on
each. Allowed outcomes: an ``AdapterValidationError`` or a validated adapter; anything else
(another exception, a case over ``CASE_LIMIT_S``) fails. The budget is bounded by
``max_examples`` and a deadline per case, so the test runs in the ordinary test command.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.adapters import AdapterValidationError, BaseModelSpec
from loraplex.adapters.uploads import AdapterValidator, UploadedFile

CASE_LIMIT_S = 1.5
"""Longest one case may take (the machine is shared: generous; a bomb takes far longer)."""
FUZZ = settings(
    max_examples=150,
    deadline=None,  # timed by hand below, with a message naming the case
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)

names = st.sampled_from(
    [
        "adapter_config.json",
        "adapter_model.safetensors",
        "a/adapter_config.json",
        "../x",
        "/abs",
        "x.bin",
        "d/",
    ]
)
payloads = st.binary(max_size=2048)
configs = st.one_of(
    st.binary(max_size=512),
    st.dictionaries(
        st.sampled_from(["r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "peft_type"]),
        st.recursive(
            st.one_of(st.integers(), st.floats(), st.text(max_size=20), st.booleans(), st.none()),
            lambda inner: (
                st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=30), inner, max_size=4)
            ),
            max_leaves=8,
        ),
        max_size=6,
    ).map(lambda d: json.dumps(d).encode()),
)


def _zip(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members:
            zf.writestr(name, data)
    return buf.getvalue()


def _tar(members: list[tuple[str, bytes]], mode: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tf:  # type: ignore[call-overload]
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@st.composite
def archives(draw: st.DrawFn) -> bytes:
    members = draw(st.lists(st.tuples(names, payloads), max_size=5))
    kind = draw(st.sampled_from(["zip", "w", "w:gz", "w:bz2", "w:xz"]))
    data = _zip(members) if kind == "zip" else _tar(members, kind)
    if draw(st.booleans()):  # mutate: flip bytes, cut, or splice
        raw = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            if raw:
                at = draw(st.integers(0, len(raw) - 1))
                raw[at] = draw(st.integers(0, 255))
        cut = draw(st.integers(0, len(raw)))
        data = bytes(raw[:cut]) if draw(st.booleans()) else bytes(raw)
    return data


def _validate(validator: AdapterValidator, files: dict[str, tuple[str, bytes]]) -> None:
    root = Path(tempfile.mkdtemp(prefix="fuzz-"))
    try:
        staging = root / "staging"
        staging.mkdir()
        uploaded = {}
        for field, (filename, data) in files.items():
            path = staging / field
            path.write_bytes(data)
            uploaded[field] = UploadedFile(field, filename, path, len(data))
        started = time.monotonic()
        with contextlib.suppress(AdapterValidationError):
            validator.validate(uploaded, staging)
        took_s = time.monotonic() - started
        assert took_s < CASE_LIMIT_S, f"a case took {took_s:.2f} s"
    finally:
        shutil.rmtree(root)


@pytest.fixture(scope="module")
def validator(spec: BaseModelSpec) -> AdapterValidator:
    return AdapterValidator(spec, 8, torch.float32)


@FUZZ
@given(data=archives(), filename=st.sampled_from(["a.zip", "a.tar.gz", "a", "a.bin"]))
def test_fuzz_archives(validator: AdapterValidator, data: bytes, filename: str) -> None:
    _validate(validator, {"file": (filename, data)})


@pytest.mark.slow
@FUZZ
@given(config=configs, weights=st.binary(max_size=4096), name=st.sampled_from(["w.safetensors", "w.bin"]))
def test_fuzz_two_file_form(validator: AdapterValidator, config: bytes, weights: bytes, name: str) -> None:
    _validate(
        validator, {"adapter_config": ("adapter_config.json", config), "adapter_model": (name, weights)}
    )
