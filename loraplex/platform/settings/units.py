"""Byte sizes as people write them: ``2GiB``, ``512MiB``, ``1e9``, ``4096``.

Every setting whose name ends in ``_bytes`` or ``_memory`` takes them, from a flag, an
environment variable or the config file alike.
"""

from __future__ import annotations

_UNITS = {
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "b": 1,
}


def is_byte_setting(name: str) -> bool:
    """Whether the setting ``name`` is a size in bytes (and so takes units)."""
    return name.endswith(("_bytes", "_memory"))


def parse_bytes(value: str | int | float) -> int:
    """``'2GiB'`` -> 2147483648; ``'1e9'`` -> 1000000000; ints pass through. ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"not a whole number of bytes: {value!r}")
        return int(value)
    text = value.strip().lower().replace("_", "")
    number, multiplier = text, 1
    for suffix, mult in _UNITS.items():
        if text.endswith(suffix):
            number, multiplier = text[: -len(suffix)].strip(), mult
            break
    try:
        amount = float(number) * multiplier
    except ValueError:
        raise ValueError(f"not a byte size: {value!r} (try 2GiB, 512MiB or 1e9)") from None
    if amount != int(amount):
        raise ValueError(f"not a whole number of bytes: {value!r}")
    return int(amount)


def format_bytes(num: int) -> str:
    """``2147483648`` -> ``'2GiB'`` when exact in a binary unit, else the plain number."""
    for suffix, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num and num % mult == 0:
            return f"{num // mult}{suffix}"
    return str(num)
