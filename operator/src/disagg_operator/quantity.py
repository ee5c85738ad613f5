"""Kubernetes resource quantities (e.g. `4Gi`, `500M`, `1.5e9`) as integers."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

_SUFFIXES: dict[str, int | Decimal] = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "m": Decimal("0.001"), "": 1,
}


def parse_quantity(value: str | int) -> int:
    """Parse a quantity into a whole number (rounded up), raising ValueError when malformed."""
    if isinstance(value, int):
        return value
    text = str(value).strip()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if suffix and text.endswith(suffix):
            number, multiplier = text[: -len(suffix)], _SUFFIXES[suffix]
            break
    else:
        number, multiplier = text, 1
    try:
        amount = Decimal(str(number)) * Decimal(multiplier)
    except InvalidOperation:
        raise ValueError(f"{value!r} is not a quantity") from None
    whole = int(amount.to_integral_value(rounding="ROUND_CEILING"))
    return whole
