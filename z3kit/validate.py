"""Argument checks shared by every z3kit and z3kit_recipes module.

One rule, one message: an int is an ``int`` that is not a ``bool`` (``True``
as a size or an id is a caller's mistake, though Python counts it as 1); a
number is an ``int`` or a ``float``, again not a ``bool``. A value of the
wrong type raises ``TypeError``; a value out of bounds raises ``ValueError``.
Every message names the argument, the rule and the value given, e.g.
``numel must be >= 0, got -1``.

The ``check_*`` functions return the value they checked, so that a caller
can check and assign in one line. The ``*_validator`` factories wrap the
same checks for ``attrs`` fields; their messages name the field as
``Class.field``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, TypeGuard

import attrs

#: what ``attrs.field(validator=...)`` takes
AttrsValidator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def is_int(value: object) -> TypeGuard[int]:
    """An ``int`` and not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """An ``int`` or a ``float``, and not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: object, *, at_least: int | None = None) -> int:
    """``value``, an int (not a bool) that is ``>= at_least`` when a bound is given."""
    if type(value) is int and (at_least is None or value >= at_least):  # noqa: E721 (the common case, on hot paths)
        return value
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if at_least is not None and value < at_least:
        raise ValueError(f"{name} must be >= {at_least}, got {value}")
    return value


def check_ints(name: str, values: Iterable[object], *, at_least: int | None = None) -> list[int]:
    """Each of ``values`` checked as by :func:`check_int`; ``name`` is their
    plural (``"numels"``), and a message quotes the first bad one."""
    out: list[int] = []
    for value in values:
        if not is_int(value):
            raise TypeError(f"{name} must be ints, got {type(value).__name__}")
        if at_least is not None and value < at_least:
            raise ValueError(f"{name} must be >= {at_least}, got {value}")
        out.append(value)
    return out


def check_number(
    name: str, value: object, *, at_least: float | None = None, above: float | None = None
) -> float:
    """``value``, a finite int or float (not a bool), ``>= at_least`` and
    ``> above`` when those bounds are given. NaN and infinities are refused."""
    if not is_number(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    bounds = [f">= {at_least}"] if at_least is not None else []
    bounds += [f"> {above}"] if above is not None else []
    rule = " ".join(["a finite number", *bounds])
    if (
        not math.isfinite(value)
        or (at_least is not None and not value >= at_least)
        or (above is not None and not value > above)
    ):
        raise ValueError(f"{name} must be {rule}, got {value}")
    return value


def check_bool(name: str, value: object) -> bool:
    """``value``, a ``bool`` (not 0 or 1, not a string)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _field_name(instance: object, attribute: attrs.Attribute[Any]) -> str:
    return f"{type(instance).__name__}.{attribute.name}"


def int_validator(*, at_least: int | None = None) -> AttrsValidator:
    """An ``attrs`` validator: the field is checked by :func:`check_int`."""

    def validate(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        check_int(_field_name(instance, attribute), value, at_least=at_least)

    return validate


def number_validator(*, at_least: float | None = None, above: float | None = None) -> AttrsValidator:
    """An ``attrs`` validator: the field is checked by :func:`check_number`."""

    def validate(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        check_number(_field_name(instance, attribute), value, at_least=at_least, above=above)

    return validate


def bool_validator() -> AttrsValidator:
    """An ``attrs`` validator: the field is checked by :func:`check_bool`."""

    def validate(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        check_bool(_field_name(instance, attribute), value)

    return validate
