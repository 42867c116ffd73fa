"""z3kit.validate: the one set of argument checks (no process group, no model)."""

from __future__ import annotations

import math

import attrs
import pytest

from z3kit.memory import MemoryKind, MemoryLedger
from z3kit.validate import (
    bool_validator,
    check_bool,
    check_int,
    check_ints,
    check_number,
    int_validator,
    is_int,
    is_number,
    number_validator,
)


@pytest.mark.parametrize(
    ("value", "int_", "number"),
    [(0, True, True), (-3, True, True), (2.5, False, True), (True, False, False), (False, False, False),
     ("1", False, False), (None, False, False), (math.nan, False, True)],
)
def test_predicates(value: object, int_: bool, number: bool) -> None:
    assert is_int(value) is int_
    assert is_number(value) is number


def test_check_int_returns_the_value_within_bounds() -> None:
    assert check_int("n", 7) == 7
    assert check_int("n", -7) == -7  # no bound: any int
    assert check_int("n", 3, at_least=3) == 3  # the bound itself is allowed


@pytest.mark.parametrize(
    ("value", "at_least", "exc", "message"),
    [
        (True, None, TypeError, "n must be an int, got bool"),
        (False, 0, TypeError, "n must be an int, got bool"),
        (1.0, None, TypeError, "n must be an int, got float"),
        ("1", None, TypeError, "n must be an int, got str"),
        (2, 3, ValueError, "n must be >= 3, got 2"),
        (-2, -1, ValueError, "n must be >= -1, got -2"),
    ],
)
def test_check_int_refuses(value: object, at_least: int | None, exc: type[Exception], message: str) -> None:
    with pytest.raises(exc) as info:
        check_int("n", value, at_least=at_least)
    assert str(info.value) == message


def test_check_ints_checks_each_and_names_the_first_bad_one() -> None:
    assert check_ints("sizes", (n for n in [1, 2, 3]), at_least=1) == [1, 2, 3]  # a generator is read once
    assert check_ints("sizes", []) == []
    with pytest.raises(TypeError) as info:
        check_ints("sizes", [1, True, 2.0])
    assert str(info.value) == "sizes must be ints, got bool"
    with pytest.raises(ValueError) as vinfo:
        check_ints("sizes", [1, 0, -5], at_least=1)
    assert str(vinfo.value) == "sizes must be >= 1, got 0"


def test_check_number() -> None:
    assert check_number("x", 0.5, at_least=0.0) == 0.5
    assert check_number("x", 0, at_least=0.0) == 0  # an int is a number
    assert check_number("x", 1e-9, above=0.0) == 1e-9
    with pytest.raises(TypeError, match="^x must be a number, got bool$"):
        check_number("x", True)
    with pytest.raises(TypeError, match="^x must be a number, got str$"):
        check_number("x", "1.0")
    with pytest.raises(ValueError, match=r"^x must be a finite number > 0.0, got 0$"):
        check_number("x", 0, above=0.0)
    with pytest.raises(ValueError, match=r"^x must be a finite number >= 0.0, got -0.5$"):
        check_number("x", -0.5, at_least=0.0)
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="^x must be a finite number"):
            check_number("x", bad)


def test_check_bool() -> None:
    assert check_bool("flag", False) is False
    for bad, name in ((0, "int"), (1, "int"), ("yes", "str"), (None, "NoneType")):
        with pytest.raises(TypeError, match=f"^flag must be a bool, got {name}$"):
            check_bool("flag", bad)


@attrs.define
class Knobs:
    count: int = attrs.field(default=1, validator=int_validator(at_least=1))
    scale: float = attrs.field(default=1.0, validator=number_validator(above=0.0))
    on: bool = attrs.field(default=True, validator=bool_validator())


def test_attrs_validators_name_class_and_field() -> None:
    Knobs(count=5, scale=0.1, on=False)
    with pytest.raises(ValueError, match=r"^Knobs.count must be >= 1, got 0$"):
        Knobs(count=0)
    with pytest.raises(TypeError, match=r"^Knobs.count must be an int, got bool$"):
        Knobs(count=True)
    with pytest.raises(ValueError, match=r"^Knobs.scale must be a finite number > 0.0, got -1$"):
        Knobs(scale=-1)
    with pytest.raises(TypeError, match=r"^Knobs.on must be a bool, got int$"):
        Knobs(on=1)  # type: ignore[arg-type]
    knobs = Knobs()
    with pytest.raises(ValueError, match="Knobs.count"):  # attrs.define validates on assignment too
        knobs.count = -1
    assert knobs.count == 1


def test_memory_ledger_refuses_bad_byte_counts() -> None:
    ledger = MemoryLedger()
    with pytest.raises(TypeError, match="nbytes must be an int, got bool"):
        ledger.allocate(MemoryKind.PARAM_SHARDS, True)
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        ledger.set(MemoryKind.PARAM_SHARDS, -1)
    assert ledger.current(MemoryKind.PARAM_SHARDS) == 0
