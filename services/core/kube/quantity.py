"""Kubernetes resource quantities ("500m", "4Gi", "1e3") as integers in gpuq's units (milli-CPU, MiB)."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1), "k": Decimal(10**3),
            "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15),
            "E": Decimal(10**18)}


def parse_quantity(value: str | int | float | Decimal) -> Decimal:
    """The quantity's value in base units. Raises ValueError naming the bad quantity."""
    if isinstance(value, Decimal):
        return value
    if isinstance(value, int | float):
        return Decimal(str(value))
    text = value.strip()
    try:
        for suffix, factor in _BINARY.items():
            if text.endswith(suffix):
                return Decimal(text[: -len(suffix)]) * factor
        if text and text[-1].isalpha():
            return Decimal(text[:-1]) * _DECIMAL[text[-1]]
        return Decimal(text)
    except (InvalidOperation, KeyError):
        raise ValueError(f"{value!r} is not a Kubernetes quantity") from None


def milli(value: str | int | float | Decimal) -> int:
    """CPU quantity -> milli-CPU, rounded up (a request is never under-counted)."""
    return int((parse_quantity(value) * 1000).to_integral_value(rounding="ROUND_CEILING"))


def mebibytes(value: str | int | float | Decimal) -> int:
    """Memory quantity -> MiB, rounded up."""
    return int((parse_quantity(value) / 2**20).to_integral_value(rounding="ROUND_CEILING"))


def count(value: str | int | float | Decimal) -> int:
    """Extended resources (GPUs, MIG slices) are whole numbers."""
    return int(parse_quantity(value))
