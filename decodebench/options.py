"""Parsers for command-line option values: each returns the value or raises
``argparse.ArgumentTypeError`` with a message naming the bad value (pytest then exits
with a usage error). Shared by the plugin and the fixture modules."""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["choice", "confidence", "float_up_to", "fraction", "fraction_up_to", "int_up_to", "non_negative_int",
           "output_dir", "parse_threshold", "positive_float", "positive_int", "positive_int_list",
           "take_negative_values"]


def positive_int(text: str) -> int:
    """``'8'`` -> 8; refuses non-integers and values below 1.

    >>> positive_int("8")
    8
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def positive_int_list(text: str) -> tuple[int, ...]:
    """``'1,64'`` -> (1, 64); every value a whole number of 1 or more.

    >>> positive_int_list("1,64")
    (1, 64)
    """
    try:
        return tuple(positive_int(v) for v in text.split(","))
    except argparse.ArgumentTypeError as exc:
        if "," not in text:
            raise
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def output_dir(text: str) -> Path:
    """An output directory, checked before any work is done: the path, or its nearest existing parent,
    must be a directory a file can be created in (it is created when the outputs are written).

    >>> output_dir("/dev/null/out")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: '/dev/null/out': /dev/null is not a directory
    """
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: name the directory (. for this one)")
    path = Path(text)
    existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {existing} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".decodebench-write-check.")
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot write there ({existing}: {exc.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    return path


def positive_float(text: str) -> float:
    """``'2.5'`` -> 2.5; refuses non-numbers, values not above 0 and infinity.

    >>> positive_float("2.5")
    2.5
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number above 0")
    return value


def choice(name: str, choices: tuple[str, ...]) -> Callable[[str], str]:
    """A parser accepting one of ``choices``; ``name`` says what the value is in errors.

    >>> choice("timer", ("kernel", "wall"))("wall")
    'wall'
    """
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"unknown {name} {text!r}; choose one of {', '.join(choices)}")
        return text

    parse.__name__ = name
    return parse


def non_negative_int(text: str) -> int:
    """``'0'`` -> 0, ``'2'`` -> 2; refuses negatives and non-integers.

    >>> non_negative_int("0"), non_negative_int("2")
    (0, 2)
    """
    if text.strip() == "0":
        return 0
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 0 or more") from None


def _as_fraction(text: str) -> float | None:
    """``'5%'`` or ``'0.05'`` -> 0.05; None where it is no number; ValueError for a bare number of 1 or more."""
    raw = text.strip()
    percent = raw.endswith("%")
    try:
        value = float(raw[:-1]) / 100 if percent else float(raw)
    except ValueError:
        return None
    if not percent and value >= 1:
        raise ValueError(f"threshold {text!r} is a bare number of 1 or more: a percentage needs its %, "
                         f"e.g. '{raw}%' (a bare number is a fraction: 0.05 is 5%)")
    return value


def parse_threshold(text: str, largest: float = 10.0) -> float:
    """A percentage (``'5%'``) or a fraction below 1 (``'0.05'``) -> 0.05; rejects anything outside
    (0, ``largest``] and a bare number of 1 or more, which is far more likely a percentage without
    its ``%`` (``--gate 5``) than a change of 500 %.

    >>> parse_threshold("5%"), parse_threshold("0.1")
    (0.05, 0.1)
    >>> parse_threshold("5")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: threshold '5' is a bare number of 1 or more: a percentage needs its %, e.g. '5%' ...
    """
    value = _as_fraction(text)
    if value is None:
        raise ValueError(f"threshold {text!r} is not a number or a percentage like '5%'")
    if not value > 0:  # NaN too
        raise ValueError(f"threshold {text!r} must be above 0 and at most {largest:.0%}")
    if value > largest:
        raise ValueError(f"{text!r} must be at most {largest:.0%}")
    return value


def fraction(text: str, largest: float = 10.0) -> float:
    """A percentage or a fraction, ``'5%'`` or ``'0.05'`` -> 0.05 (the gate's threshold syntax), at
    most ``largest``.

    >>> fraction("5%")
    0.05
    """
    try:
        return parse_threshold(text, largest)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fraction_up_to(largest: float) -> Callable[[str], float]:
    """A :func:`fraction` parser that also refuses values above ``largest`` (its sane range).

    >>> fraction_up_to(0.5)("20%")
    0.2
    >>> fraction_up_to(0.5)("60%")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: '60%' must be at most 50%
    """
    def parse(text: str) -> float:
        return fraction(text, largest)

    parse.__name__ = "fraction"
    return parse


def int_up_to(largest: int, smallest: int = 1) -> Callable[[str], int]:
    """A whole-number parser for ``[smallest, largest]`` (``smallest`` is 0 or 1).

    >>> int_up_to(20, 0)("3")
    3
    >>> int_up_to(20, 0)("1000000")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: '1000000' must be at most 20
    """
    first = non_negative_int if smallest == 0 else positive_int

    def parse(text: str) -> int:
        value = first(text)
        if value > largest:
            raise argparse.ArgumentTypeError(f"{text!r} must be at most {largest}")
        return value

    parse.__name__ = "integer"
    return parse


def float_up_to(largest: float) -> Callable[[str], float]:
    """A :func:`positive_float` parser that also refuses values above ``largest``.

    >>> float_up_to(3600.0)("7200")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: '7200' must be at most 3600
    """
    def parse(text: str) -> float:
        value = positive_float(text)
        if value > largest:
            raise argparse.ArgumentTypeError(f"{text!r} must be at most {largest:g}")
        return value

    parse.__name__ = "number"
    return parse


def confidence(text: str) -> float:
    """A confidence level in [50 %, 100 %): ``'95%'`` -> 0.95.

    >>> confidence("95%")
    0.95
    """
    try:
        value = _as_fraction(text)  # '95': the hint that a percentage needs its % says more than the range
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value is None or not 0.5 <= value < 1:
        raise argparse.ArgumentTypeError(f"confidence {text!r} must lie in [50%, 100%), e.g. 95%")
    return value


# argparse reads an argument that starts with "-" as an option unless it matches its own pattern of
# a negative number (-5, -.5): "--gate -5%" then ends in "expected one argument", which names no
# problem. This pattern also lets -5%, -0.5% and -1e-3 through as values, for their parser to refuse
# by name ("threshold '-5%' must be above 0").
NEGATIVE_VALUE = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?%?$")


def take_negative_values(parser: argparse.ArgumentParser) -> None:
    """Let ``parser`` hand negative numbers and percentages (``-5%``) to the option before them.

    >>> p = argparse.ArgumentParser()
    >>> _ = p.add_argument("--gate")
    >>> take_negative_values(p)
    >>> p.parse_args(["--gate", "-5%"]).gate  # argparse alone: "argument --gate: expected one argument"
    '-5%'
    """
    parser._negative_number_matcher = NEGATIVE_VALUE  # argparse's own attribute for this test (3.10-3.14)
