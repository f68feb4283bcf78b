"""f32 rounding and the exact text Rust gives a float: serde_json numbers and ``Display``.

serde_json (1.0.14x and later) prints floats with the ``zmij`` crate: the shortest digits that
read back to the same value, in plain notation when the decimal exponent of the first digit
lies in ``[-5, 15]`` for f64 (``[-6, 12]`` for f32), otherwise as ``d.ddde+X`` / ``de-X``;
integral values keep a ``.0``. Older serde_json (ryu) printed the same except ``e20`` for
``e+20``; tensorswap writes the current form and reads both.
"""

from __future__ import annotations

import math
import re
import struct

_F32 = struct.Struct("<f")

F32_MAX = 3.4028234663852886e38
"""The largest finite f32, as a Python float."""


def f32(value: float) -> float:
    """Round ``value`` to the nearest f32 (ties to even) like Rust's ``as f32``; overflow: ±inf."""
    try:
        result: float = _F32.unpack(_F32.pack(value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)
    return result


def _split(text: str) -> tuple[bool, str, int]:
    """Split a shortest repr (``-1.25e-07``, ``0.001``) into sign, digits, exponent of digit one."""
    negative = text.startswith("-")
    if negative:
        text = text[1:]
    mantissa, _, exponent = text.partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = whole + fraction
    point = len(whole) + (int(exponent) if exponent else 0)
    stripped = digits.lstrip("0")
    leading = len(digits) - len(stripped)
    stripped = stripped.rstrip("0")
    if not stripped:
        return negative, "0", 0
    return negative, stripped, point - leading - 1


def _layout(negative: bool, digits: str, exp: int, fixed: range) -> str:
    """Lay out shortest digits the way zmij does (see the module docstring)."""
    sign = "-" if negative else ""
    if digits == "0":
        return sign + "0.0"
    if exp in fixed:
        if exp < 0:
            return f"{sign}0.{'0' * (-exp - 1)}{digits}"
        if len(digits) <= exp + 1:
            return f"{sign}{digits}{'0' * (exp + 1 - len(digits))}.0"
        return f"{sign}{digits[: exp + 1]}.{digits[exp + 1 :]}"
    mantissa = digits if len(digits) == 1 else f"{digits[0]}.{digits[1:]}"
    return f"{sign}{mantissa}e{'+' if exp >= 0 else '-'}{abs(exp)}"


def _f32_shortest(value: float) -> tuple[bool, str, int]:
    import numpy as np  # only the slow, human-facing formatting paths need it

    text = np.format_float_scientific(np.float32(value), unique=True, trim="-")
    return _split(text)


def serde_f32(value: float) -> str:
    """The text serde_json writes for ``value as f32`` (shortest f32 digits): 0.1 -> ``0.1``."""
    return _layout(*_f32_shortest(f32(value)), fixed=range(-6, 13))


def serde_f64(value: float) -> str:
    """The text serde_json writes for an f64 (shortest f64 digits): 1e16 -> ``1e+16``."""
    return _layout(*_split(repr(value)), fixed=range(-5, 16))


def rust_display_f32(value: float) -> str:
    """Rust's ``{}`` for an f32: shortest digits, never an exponent, no ``.0`` (``[0.5, 2]``)."""
    value = f32(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    negative, digits, exp = _f32_shortest(value)
    sign = "-" if negative else ""
    if digits == "0":
        return sign + "0"
    if exp < 0:
        return f"{sign}0.{'0' * (-exp - 1)}{digits}"
    if len(digits) <= exp + 1:
        return f"{sign}{digits}{'0' * (exp + 1 - len(digits))}"
    return f"{sign}{digits[: exp + 1]}.{digits[exp + 1 :]}"


# msgspec prints f64 exactly as ryu did (same digits, same plain/exponent split) but without the
# ``+`` of positive exponents that serde_json's zmij writes. Only a digit, ``e``, digit run can
# need the fix; string contents are skipped by matching whole JSON strings first.
_MAYBE_EXPONENT = re.compile(rb"\de\d")
_EXPONENT_OR_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"|(?<=\d)e(?=\d)')


def _plus(match: re.Match[bytes]) -> bytes:
    text = match.group(0)
    return text if text[:1] == b'"' else b"e+"


def plus_exponents(data: bytes) -> bytes:
    """Rewrite ``1e16`` as ``1e+16`` in compact JSON, leaving string contents alone."""
    if _MAYBE_EXPONENT.search(data) is None:
        return data
    return _EXPONENT_OR_STRING.sub(_plus, data)


__all__ = ["F32_MAX", "f32", "plus_exponents", "rust_display_f32", "serde_f32", "serde_f64"]
