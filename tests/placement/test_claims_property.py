"""Placement claims as peers gossip them, with generated values for every field: a claim out
of range is refused with ClaimError naming the field, never coerced into a plan (an epoch of
"7", a stage host of 5, "false" as ready), and nothing else comes out of reading the claims
of a snapshot."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.gossip.failure import PeerState
from meshagent.placement.negotiation import Claim, ClaimError
from meshagent.placement.planner import Plan, StageAssignment
from meshagent.placement.service import EXTRAS_KEY, claims_for
from tests.peer_values import any_cbor, not_an_int, outside, wide_ints

N_LAYERS = 30
STAGES = (StageAssignment("a", 0, 10), StageAssignment("b", 10, 30))
SPLIT = Claim("m", 7, "p", Plan("m", 1000, stages=STAGES, est_token_ms=30.0), True)
WHOLE = Claim("m", 3, "p", Plan("m", 1000, replicas=("a", "b"), est_token_ms=12.5), False)


not_a_peer = st.one_of(
    st.integers(-(2**70), 2**70),
    wide_ints,
    not_an_int.filter(lambda v: not isinstance(v, str)),
    st.just(""),
    st.text(min_size=65, max_size=80),
)

# Every field: (claim, path, what the error names, values it may not hold).
FIELDS: list[tuple[Claim, tuple[Any, ...], str, st.SearchStrategy[Any]]] = [
    (SPLIT, (0,), "version", outside(range(1, 2))),
    (SPLIT, (1,), "model", st.one_of(not_a_peer, st.just("x" * 256))),
    (SPLIT, (2,), "epoch", outside(range(2**63))),
    (SPLIT, (3,), "proposer", not_a_peer),
    (SPLIT, (4,), "context", outside(range(1, 2**31))),
    (WHOLE, (5,), "replica", st.one_of(not_a_peer, st.just(["a"] * 257))),
    (WHOLE, (5, 0), "replica", not_a_peer),
    (WHOLE, (5, 1), "replica", st.just("a")),  # twice
    (SPLIT, (6,), "stage", st.one_of(not_a_peer, st.just([["a", 0, 30]] * 257))),
    (SPLIT, (6, 0), "stage", st.one_of(not_a_peer, st.lists(st.just("a"), max_size=4))),
    (SPLIT, (6, 0, 0), "stage", not_a_peer),
    (SPLIT, (6, 1, 0), "stage", st.just("a")),  # one host for two stages
    (SPLIT, (6, 0, 1), "stage", outside(range(0, 1))),  # the first stage starts at 0
    (SPLIT, (6, 0, 2), "stage", outside(range(10, 11))),  # and ends where the next starts
    (SPLIT, (6, 1, 1), "stage", outside(range(10, 11))),
    (SPLIT, (6, 1, 2), "stage", outside(range(N_LAYERS, N_LAYERS + 1))),  # the model's last
    (SPLIT, (7,), "ready", st.one_of(st.integers(-2, 2), st.none(), st.text(max_size=5))),
    (
        SPLIT,
        (8,),
        "est_token_ms",
        st.one_of(
            st.floats(max_value=-1e-9),
            st.sampled_from([math.nan, -math.inf, True, "1", None]),
            wide_ints,
        ),
    ),
]


def with_value(claim: Claim, path: tuple[Any, ...], value: Any) -> dict[int, Any]:
    d = claim.to_cbor()
    d[5], d[6] = list(d[5]), [list(s) for s in d[6]]
    *outer, last = path
    holder: Any = d
    for k in outer:
        holder = holder[k]
    holder[last] = value
    return d


def test_both_claims_round_trip():
    for claim in (SPLIT, WHOLE):
        assert Claim.from_cbor(claim.to_cbor(), model_id="m", n_layers=N_LAYERS) == claim


def test_a_plan_estimated_at_infinity_is_a_plan_still():
    """The planner's estimate on a peer whose record gives a speed of 5e-324 (which gossip
    takes): refusing it would leave the model without any plan."""
    slow = Claim("m", 1, "p", Plan("m", 1000, replicas=("a",), est_token_ms=math.inf), True)
    assert Claim.from_cbor(slow.to_cbor(), model_id="m", n_layers=N_LAYERS) == slow


def _int_paths(v: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(v, dict):
        return [p for k, x in v.items() for p in _int_paths(x, (*path, k))]
    if isinstance(v, list | tuple):
        return [p for i, x in enumerate(v) for p in _int_paths(x, (*path, i))]
    return [path] if type(v) is int else []


def test_the_table_names_every_integer_of_both_claims():
    listed = {path for _, path, _, _ in FIELDS}
    for claim in (SPLIT, WHOLE):
        assert set(_int_paths(claim.to_cbor())) <= listed


@pytest.mark.parametrize(
    ("claim", "path", "named", "values"),
    FIELDS,
    ids=[f"{'/'.join(map(str, f[1]))}-{f[2]}" for f in FIELDS],
)
@settings(max_examples=40)
@given(data=st.data())
def test_a_field_out_of_range_is_refused_naming_it(claim, path, named, values, data):
    value = data.draw(values, label=named)
    with pytest.raises(ClaimError, match=named):
        Claim.from_cbor(with_value(claim, path, value), model_id="m", n_layers=N_LAYERS)


def test_a_claim_for_another_model_or_layer_count_is_refused():
    with pytest.raises(ClaimError, match="model"):
        Claim.from_cbor(SPLIT.to_cbor(), model_id="other", n_layers=N_LAYERS)
    with pytest.raises(ClaimError, match="stage"):
        Claim.from_cbor(SPLIT.to_cbor(), model_id="m", n_layers=N_LAYERS + 1)


def test_a_plan_with_both_replicas_and_stages_or_neither_is_refused():
    both = {**SPLIT.to_cbor(), 5: ["c"]}
    neither = {**SPLIT.to_cbor(), 6: []}
    for d in (both, neither):
        with pytest.raises(ClaimError, match="replicas"):
            Claim.from_cbor(d, model_id="m", n_layers=N_LAYERS)


cbor_values = any_cbor(9, size=8)


@settings(max_examples=300)
@given(st.one_of(cbor_values, st.dictionaries(st.integers(0, 9), cbor_values, max_size=9)))
def test_any_value_is_a_claim_or_a_claim_error(value):
    with contextlib.suppress(ClaimError):
        Claim.from_cbor(value, model_id="m", n_layers=N_LAYERS)


def view(extras: Any) -> SimpleNamespace:
    return SimpleNamespace(state=PeerState.ALIVE, record=SimpleNamespace(extras=extras))


@pytest.mark.parametrize(
    "bad",
    [
        with_value(SPLIT, (2,), math.inf),  # int(inf): OverflowError
        with_value(SPLIT, (8,), 10**400),  # float(10**400): OverflowError
        with_value(SPLIT, (2,), 10**5000),
        with_value(SPLIT, (6, 0, 1), "0"),
        with_value(SPLIT, (7,), "false"),
        with_value(SPLIT, (6, 1, 2), 31),
    ],
    ids=["epoch-inf", "est-bignum", "epoch-bignum", "start-text", "ready-text", "past-last-layer"],
)
def test_a_peer_gossiping_a_bad_claim_is_skipped_not_raised(bad):
    views = {
        "bad": view({EXTRAS_KEY: {"m": bad}}),
        "good": view({EXTRAS_KEY: {"m": SPLIT.to_cbor()}}),
        "odd": view({EXTRAS_KEY: ["m"]}),
    }
    assert claims_for("m", views, n_layers=N_LAYERS) == {"good": SPLIT}
