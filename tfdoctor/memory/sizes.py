"""Byte sizes in and out: "24GiB", "80GB", "512M" -> int, and int -> "56.1 GiB". No torch."""

from __future__ import annotations

import re

from tfdoctor.errors import UsageError

# Decimal units are powers of 1000 (as GPU vendors and disk makers quote them), binary units powers
# of 1024. A bare K/M/G/T is binary, as `free -h`, Docker and most memory tools read it.
_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
    "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
}
MAX_SIZE = 2.0 ** 70  # 1 ZiB: no budget is larger, and the float arithmetic stays exact enough
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in `text`; raises UsageError on anything that is not a positive size."""
    match = _SIZE.match(str(text))
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise UsageError(f"cannot read {text!r} as a size", "write it like 24GiB, 80GB or 512MiB")
    value = float(match.group(1)) * _UNITS[unit]
    if not value < MAX_SIZE:  # also catches a 400-digit number, which float() makes infinite
        shown = text if len(text) <= 24 else f"{text[:12]}...{text[-6:]} ({len(text)} characters)"
        raise UsageError(f"size {shown} is beyond any machine's memory", "write it like 24GiB, 80GB or 512MiB")
    nbytes = int(value)
    if nbytes <= 0:
        raise UsageError(f"size {text!r} must be positive")
    return nbytes


def format_bytes(nbytes: float) -> str:
    """Binary units with one decimal: 60284841916 -> '56.1 GiB'."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover
