"""A peer's value quoted in an error message: short, and printable whatever it is."""

from __future__ import annotations

from meshagent.wire.quoted import quoted


def test_short_values_are_their_repr():
    assert quoted(5) == "5"
    assert quoted("POST") == "'POST'"
    assert quoted(True) == "True"
    assert quoted(None) == "None"


def test_wide_integers_are_shown_by_their_width():
    assert quoted(2**64) == "an integer of 65 bits"
    assert quoted(-(10**5000)) == "-an integer of 16610 bits"  # past what Python prints


def test_long_values_are_cut():
    assert len(quoted("x" * (16 << 20))) == 40
    assert len(quoted(b"x" * 1000, limit=20)) == 20
    assert quoted([10**5000]) == "a list"
