"""Demand as peers gossip it, with generated values for every field: a value out of its
range is refused with DemandError naming it, never taken as demand (a bucket of "7" tokens,
an expiry of NaN, buckets out of order), and nothing else comes out of reading a peer's
form."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.placement.demand import (
    BUCKETS,
    MAX_MODELS,
    Bucket,
    Demand,
    DemandError,
    from_cbor,
    to_cbor,
)
from tests.peer_values import any_cbor, not_an_int, outside, wide_ints

FORM = to_cbor(
    {
        "m": Demand((Bucket(100, 2, 300), Bucket(101, 1, 40)), 6060.5, 6360.5, 1),
        "never": Demand((Bucket(101, 1, 1),), 6070.0, math.inf, 0),
    }
)

not_a_time = st.one_of(
    st.floats(max_value=-1e-9),
    st.floats(min_value=2.0**40),
    st.integers(min_value=2**40, max_value=2**70),
    wide_ints,
    st.sampled_from([math.nan, math.inf, -math.inf, True, "5", -1]),
    not_an_int.filter(lambda v: not isinstance(v, float)),
)
not_a_model = st.one_of(
    st.integers(-5, 5), st.binary(max_size=4), st.just(""), st.text(min_size=256, max_size=300)
)

# Every field: (path, what the error names, values it may not hold).
FIELDS: list[tuple[tuple[Any, ...], str, st.SearchStrategy[Any]]] = [
    ((0,), "version", outside(range(1, 2))),
    ((1,), "models", st.one_of(not_an_int, st.integers())),
    ((1, "m"), "for", st.one_of(not_an_int, st.lists(st.integers(0, 3), min_size=5))),
    ((1, "m", 0), "in flight", outside(range(2**16))),
    ((1, "m", 1), "last used", not_a_time),
    ((1, "m", 2), "expiry", not_a_time.filter(lambda v: v is not None)),  # None: never
    ((1, "m", 3), "buckets", st.one_of(
        not_an_int.filter(lambda v: not isinstance(v, list)),
        st.just([[i, 1, 1] for i in range(BUCKETS + 2)]),
    )),
    ((1, "m", 3, 0), "bucket", st.one_of(st.integers(), st.lists(st.integers(0, 3)).filter(
        lambda v: len(v) != 3))),
    ((1, "m", 3, 0, 0), "bucket", outside(range(2**40))),
    ((1, "m", 3, 0, 1), "requests", outside(range(2**32))),
    ((1, "m", 3, 0, 2), "tokens", outside(range(2**48))),
    ((1, "m", 3, 1, 0), "bucket", st.integers(-(2**8), 100)),  # not after the one before
    ((1, "m", 3, 1, 1), "requests", outside(range(2**32))),
    ((1, "m", 3, 1, 2), "tokens", outside(range(2**48))),
]  # fmt: skip


def with_value(path: tuple[Any, ...], value: Any) -> dict[Any, Any]:
    d = {
        0: FORM[0],
        1: {m: [v[0], v[1], v[2], [list(b) for b in v[3]]] for m, v in FORM[1].items()},
    }
    *outer, last = path
    holder: Any = d
    for k in outer:
        holder = holder[k]
    holder[last] = value
    return d


def _int_paths(v: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(v, dict):
        return [p for k, x in v.items() for p in _int_paths(x, (*path, k))]
    if isinstance(v, list | tuple):
        return [p for i, x in enumerate(v) for p in _int_paths(x, (*path, i))]
    return [path] if type(v) is int else []


def test_the_form_round_trips():
    assert to_cbor(from_cbor(FORM)) == FORM


def test_the_table_names_every_integer_of_a_model():
    listed = {path for path, _, _ in FIELDS}
    assert {p for p in _int_paths(FORM) if p[:2] != (1, "never")} <= listed


@pytest.mark.parametrize(
    ("path", "named", "values"), FIELDS, ids=["/".join(map(str, f[0])) for f in FIELDS]
)
@settings(max_examples=40)
@given(data=st.data())
def test_a_field_out_of_range_is_refused_naming_it(path, named, values, data):
    value = data.draw(values, label=named)
    with pytest.raises(DemandError, match=named):
        from_cbor(with_value(path, value))


@settings(max_examples=40)
@given(st.one_of(not_a_model))
def test_a_model_id_that_is_no_short_text_is_refused(model_id):
    d = with_value((1,), {model_id: FORM[1]["m"]})
    with pytest.raises(DemandError, match="model id"):
        from_cbor(d)


def test_too_many_models_are_refused():
    d = with_value((1,), {f"m{i}": FORM[1]["m"] for i in range(MAX_MODELS + 1)})
    with pytest.raises(DemandError, match="models"):
        from_cbor(d)


def test_never_is_none_and_a_time_may_be_an_integer():
    d = with_value((1, "m", 2), None)
    d[1]["m"][1] = 6060
    got = from_cbor(d)["m"]
    assert got.expires_at == math.inf and got.last_used == 6060.0


cbor_values = any_cbor(3, size=8)


@settings(max_examples=300)
@given(
    st.one_of(
        cbor_values,
        st.fixed_dictionaries(
            {0: st.just(1), 1: st.dictionaries(st.text(max_size=3), cbor_values, max_size=3)}
        ),
        st.fixed_dictionaries(
            {
                0: st.just(1),
                1: st.dictionaries(
                    st.sampled_from(["m", "n"]),
                    st.tuples(cbor_values, cbor_values, cbor_values, cbor_values).map(list),
                    max_size=2,
                ),
            }
        ),
    )
)
def test_any_value_is_demand_or_a_demand_error(value):
    with contextlib.suppress(DemandError):
        got = from_cbor(value)
        assert all(isinstance(d, Demand) for d in got.values())
