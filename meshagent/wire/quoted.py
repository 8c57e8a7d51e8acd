"""A value a peer sent, as an error message quotes it: short, and printable whatever it is.

`repr` is not enough: Python refuses to print an integer past 4300 digits (ValueError), and
a CBOR bignum of a few kilobytes is one; a 16 MiB string would be copied whole to be cut.
"""

from __future__ import annotations

_INT_BITS = 64  # an integer wider than this is shown by its width


def quoted(value: object, limit: int = 40) -> str:
    """`value`'s repr cut to `limit` characters; a wide integer as its width in bits."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _INT_BITS:
        sign = "-" if value < 0 else ""
        return f"{sign}an integer of {value.bit_length()} bits"
    if isinstance(value, str | bytes | bytearray) and len(value) > limit:
        value = value[: limit + 1]  # enough to show that it goes on
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # a container holding a wide integer, or deep
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
