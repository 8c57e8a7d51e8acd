"""Values a peer may send where an integer belongs, for the decoders' property tests: anything
its message's type allows, so out of range, wider than any counter, or not an integer."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

not_an_int = st.one_of(
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(0, 3), max_size=2),
)
# Past 64 bits, and past the 4300 digits Python prints: an error message must not try. (Made
# by a map: hypothesis itself would try to print a strategy that holds one.)
wide_ints = st.one_of(
    st.integers(min_value=2**64, max_value=2**200),
    st.integers(min_value=-(2**200), max_value=-(2**64)),
    st.integers(0, 3).map(lambda k: -(10 ** (5000 + k)) if k % 2 else 10 ** (5000 + k)),
)


def outside(allowed: range) -> st.SearchStrategy[Any]:
    """Anything but an integer in `allowed`: its neighbours, far beyond, and other types."""
    return st.one_of(
        st.integers(max_value=allowed.start - 1),
        st.integers(min_value=allowed.stop, max_value=allowed.stop + 2**70),
        wide_ints,
        st.sampled_from([allowed.start - 1, allowed.stop, True, float(allowed.start), "7"]),
        not_an_int,
    )


def any_cbor(keys: int, *, size: int = 40, leaves: int = 16) -> st.SearchStrategy[Any]:
    """Any CBOR value: scalars, and lists and maps of them (map keys 0 to `keys`)."""
    return st.recursive(
        st.one_of(
            st.integers(-(2**70), 2**70),
            st.binary(max_size=size),
            st.text(max_size=size),
            st.booleans(),
            st.none(),
            st.floats(),
        ),
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.integers(0, keys), inner, max_size=4)
        ),
        max_leaves=leaves,
    )
