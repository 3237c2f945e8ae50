"""The calculator tool's arithmetic (megarl/reward/tools.py) against what a policy may write: a tower
of powers, numbers past a double, a literal too long to print. Each answer is an exact value or
"error", never a crash of the controller or an hours-long computation."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import pytest

from megarl.reward.tools import MAX_BITS, MAX_POW, _fmt, calculate


def test_values_are_exact():
    assert calculate("2 ** 10") == 1024 and calculate("7 / 2") == Fraction(7, 2)
    assert calculate("(3 - 5) * 4 // 3") == -3 and calculate("0.1 + 0.2") == Fraction(3, 10)
    assert calculate("2 ** -3") == Fraction(1, 8)


@pytest.mark.parametrize("expr", ["__import__('os')", "1/0", "2 ** 0.5", f"2 ** {MAX_POW + 1}", "x + 1"])
def test_what_is_not_arithmetic_within_bounds_is_none(expr):
    assert calculate(expr) is None


@pytest.mark.parametrize("expr", ["((9**64)**64)**64",      # 830k bits: each power within MAX_POW
                                  "((2**15)**13)**21 * 2",  # 2**4096 (4097 bits), through a product
                                  "1 / ((2**15)**13)**21 / 2",  # the denominator's bits count alike
                                  "9" * 1300])              # a literal of ~4300 bits
def test_a_value_past_max_bits_is_refused(expr):
    assert calculate(expr) is None and _fmt(calculate(expr)) == "error"


def test_a_tower_of_powers_stops_at_the_first_value_past_the_bound():
    """Unbounded, the fourth **64 would run for hours holding the GIL (the controller's): the third
    (830k bits) is refused before it. A thread, so that the planted break fails instead of hanging."""
    import threading

    got = []
    worker = threading.Thread(target=lambda: got.append(calculate("(((9**64)**64)**64)**64")), daemon=True)
    worker.start()
    worker.join(60)  # milliseconds when bounded; ~15 s for the third level alone unbounded (here)
    assert got == [None]


def test_the_largest_values_are_computed_and_printed():
    top = calculate("((2**15)**13)**21 + (((2**15)**13)**21 - 1)")  # 2**4096 - 1: 4096 bits, in
    assert top == 2 ** MAX_BITS - 1
    assert _fmt(top) == str(2 ** MAX_BITS - 1)
    big = calculate("(2**64)**63 / 3")  # 2**4032 / 3: past a double (float() overflows)
    printed = _fmt(big)
    assert abs(Fraction(Decimal(printed)) / big - 1) < Fraction(1, 10 ** 9), printed  # 10 digits of the value
    assert calculate("(2**64)**64 / 3") is None  # its numerator, 2**4096, is one bit past the bound
    assert _fmt(calculate("1/3")) == "0.3333333333"
