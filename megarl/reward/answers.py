"""Final-answer extraction: the only text of a reply a reward ever looks at.

Scoring free text with an expression parser rewards a reply that restates the question ("To find
12 + 7, we ..." evaluates to 19), and a policy learns that within a few steps. So every reward here
first extracts ONE final answer, and compares only that:

- :func:`last_number`: the last number of the reply (flexible arithmetic / gsm8k),
- :func:`only_number`: the reply is nothing but a number (strict arithmetic),
- :func:`hash_answer`: the number after the last ``####`` (gsm8k),
- :func:`last_boxed`: the content of the last ``\\boxed{...}`` (math).

Numbers are normalised the same way everywhere (:func:`to_number`): thousands separators
(``1,234``), a unicode minus or en-dash as minus, a leading ``$``, a trailing period, ``19.0`` equal
to ``19``. They are parsed as exact :class:`fractions.Fraction` values (never ``eval``'d, never
floats), so ``0.1 + 0.2`` style rounding cannot make a wrong answer right. A slash is not part of a
number (``1/2`` is the numbers 1 and 2): a fraction here would be an expression, and expressions are
what the ``math`` reward's symbolic check is for.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

from megarl.data.schemas import last_boxed  # noqa: F401  (one implementation, re-exported)

# Dashes a model (or a tokenizer's detokenizer) writes for minus: U+2212 minus, U+2013 en dash,
# U+2012 figure dash, U+FE63 small hyphen-minus, U+FF0D fullwidth hyphen-minus.
_MINUS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2012": "-", "\ufe63": "-", "\uff0d": "-"})

# A number: optional sign, optional '$', digits with proper thousands groups ("1,234", never a prefix
# of "1,2345") or plain, optional decimals; or a bare '.5'.
_DIGITS = r"(?P<digits>\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_NUMBER = re.compile(r"(?P<sign>-\s?)?\$?\s?" + _DIGITS)
_ONLY_NUMBER = re.compile(r"=?\s*(?P<sign>-)?\s?\$?\s?" + _DIGITS + r"\s*\.?")
_HASH_ANSWER = re.compile(r"####\s*(?P<answer>[^\n]*)")
# Longest digit run read as a number: Python refuses to convert more than 4300 digits
# (sys.get_int_max_str_digits(), its default), so a degenerate reply of repeated digits would raise
# in the reward and could stop the job; no gold answer is that long, so a longer run is read as a
# number that equals none (None: the reply is wrong, never crashed).
MAX_DIGITS = 4000


def normalize(text: str) -> str:
    """Unicode minus signs as '-'."""
    return text.translate(_MINUS)


def to_number(text: str) -> Optional[Fraction]:
    """The exact value of a number written as ``text`` ('1,234', '-0.5', '$19', '19.'), else None."""
    m = _ONLY_NUMBER.fullmatch(normalize(text).strip())
    return _value(m) if m else None


def _value(m: re.Match, negative: bool = True) -> Optional[Fraction]:
    """The match's number; None when it has more than MAX_DIGITS digits (it equals no gold answer)."""
    digits = m.group("digits").replace(",", "")
    if len(digits) > MAX_DIGITS:
        return None
    value = Fraction(digits)
    return -value if negative and m.group("sign") else value


def _is_binary_minus(text: str, at: int) -> bool:
    """Whether the '-' at ``text[at]`` is a subtraction, not a sign: right after a letter or digit
    ("x-1", "12-7"), or after a digit or closing bracket across spaces ("12 - 7"); "is -5" is a sign."""
    before = text[:at]
    if before[-1:].isalnum() or before[-1:] == "_":
        return True
    stripped = before.rstrip()
    return bool(stripped) and (stripped[-1].isdigit() or stripped[-1] in ")]}")


def numbers(text: str) -> list[Optional[Fraction]]:
    """Every number in ``text``, in order ("12-7=5" -> 12, 7, 5; "x = -5" -> -5); None for one of more
    than MAX_DIGITS digits."""
    text = normalize(text)
    return [_value(m, negative=not (m.group("sign") and _is_binary_minus(text, m.start())))
            for m in _NUMBER.finditer(text)]


def last_number(text: str) -> Optional[Fraction]:
    """The last number in ``text`` (None when it has none, or when it is longer than MAX_DIGITS):
    "12 + 7 = 19." -> 19; "19 or 20" -> 20."""
    found = numbers(text)
    return found[-1] if found else None


def only_number(text: str) -> Optional[Fraction]:
    """The number when ``text`` is nothing else (whitespace, a leading '=' or '$', a trailing period
    allowed): "19." -> 19, " = 19" -> 19, "12 + 7 = 19" -> None."""
    return to_number(text)


def hash_answer(text: str) -> Optional[Fraction]:
    """The number right after the last ``####`` (GSM8K's answer marker), None without one."""
    matches = list(_HASH_ANSWER.finditer(normalize(text)))
    if not matches:
        return None
    m = _NUMBER.match(matches[-1].group("answer").strip())
    return _value(m) if m else None  # the answer starts right after '####': a sign there is a sign


