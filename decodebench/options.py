"""Parsers for command-line option values: each returns the value or raises
``argparse.ArgumentTypeError`` with a message naming the bad value (pytest then exits
with a usage error). Shared by the plugin and the fixture modules."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["choice", "confidence", "fraction", "non_negative_int", "parse_threshold", "positive_float", "positive_int"]


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


def parse_threshold(text: str) -> float:
    """``'5%'`` or ``'0.05'`` -> 0.05; rejects anything outside (0, 10).

    >>> parse_threshold("5%"), parse_threshold("0.1")
    (0.05, 0.1)
    """
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ValueError(f"threshold {text!r} is not a number or a percentage like '5%'") from None
    if not 0 < value < 10:
        raise ValueError(f"threshold {text!r} must be above 0 and below 1000%")
    return value


def fraction(text: str) -> float:
    """A percentage or a fraction, ``'5%'`` or ``'0.05'`` -> 0.05 (the gate's threshold syntax).

    >>> fraction("5%")
    0.05
    """
    try:
        return parse_threshold(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def confidence(text: str) -> float:
    """A confidence level in [50 %, 100 %): ``'95%'`` -> 0.95.

    >>> confidence("95%")
    0.95
    """
    value = fraction(text)
    if not 0.5 <= value < 1:
        raise argparse.ArgumentTypeError(f"confidence {text!r} must lie in [50%, 100%), e.g. 95%")
    return value
