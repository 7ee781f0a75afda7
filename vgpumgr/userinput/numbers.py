"""Numbers a user types: ASCII digits only (Python's int() and float() also read '٥', '1_000' and ' 5 '),
bounded by what the hardware or the protocol allows. `integer`/`decimal` make argparse types (a refusal is
argparse's usage error, exit 2); `parse_int` is the same rule for a number inside another value."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

from vgpumgr.errors import InvalidInput

_INT = re.compile(r"-?[0-9]+", re.ASCII)
_DECIMAL = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)", re.ASCII)
MAX_DIGITS = 18


def parse_int(text: str, what: str, lo: int, hi: int, hint: str | None = None) -> int:
    """`text` as an integer in [lo, hi], else InvalidInput naming `what` and the bounds."""
    if not isinstance(text, str) or not _INT.fullmatch(text) or len(text) > MAX_DIGITS:
        raise InvalidInput(f"{what}: {_shown(text)} is not a whole number (ASCII digits)",
                           hint=hint or f"give a number from {lo} to {hi}")
    value = int(text)
    if not lo <= value <= hi:
        raise InvalidInput(f"{what}: {value} is out of range", hint=hint or f"give a number from {lo} to {hi}")
    return value


def parse_decimal(text: str, what: str, lo: float, hi: float, hint: str | None = None) -> float:
    if not isinstance(text, str) or not _DECIMAL.fullmatch(text) or len(text) > MAX_DIGITS:
        raise InvalidInput(f"{what}: {_shown(text)} is not a number (ASCII digits, a point)",
                           hint=hint or f"give a number from {lo:g} to {hi:g}")
    value = float(text)
    if not lo <= value <= hi:
        raise InvalidInput(f"{what}: {value:g} is out of range", hint=hint or f"give a number from {lo:g} to {hi:g}")
    return value


def _shown(text: object) -> str:
    shown = repr(text)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def _argparse_type(parse: Callable[[str], object], name: str) -> Callable[[str], object]:
    def convert(text: str) -> object:
        try:
            return parse(text)
        except InvalidInput as e:
            raise argparse.ArgumentTypeError(f"{e.message} ({e.hint})") from None

    convert.__name__ = name  # argparse names the type in its message
    convert.userinput = True  # type: ignore[attr-defined]  # tests/test_hostile.py: every number uses these
    return convert


def integer(lo: int, hi: int, what: str = "value") -> Callable[[str], object]:
    """An argparse `type=`: an integer in [lo, hi] written in ASCII digits."""
    return _argparse_type(lambda text: parse_int(text, what, lo, hi), "integer")


def decimal(lo: float, hi: float, what: str = "value") -> Callable[[str], object]:
    """An argparse `type=`: a finite decimal number in [lo, hi] (no exponent, no nan/inf)."""
    return _argparse_type(lambda text: parse_decimal(text, what, lo, hi), "number")
