import base64
import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshagent.identity.mesh import (
    Invite,
    InviteError,
    MeshSecret,
    decode_invite,
    encode_invite,
)

SECRET = MeshSecret(bytes(range(32)))


def test_fingerprint_is_stable_short_and_distinct():
    assert SECRET.fingerprint == MeshSecret(bytes(range(32))).fingerprint
    assert len(SECRET.fingerprint) == 26
    assert SECRET.fingerprint != MeshSecret(bytes(range(1, 33))).fingerprint


def test_fingerprint_and_repr_do_not_reveal_the_secret():
    encodings = [
        SECRET.value.hex(),
        base64.b32encode(SECRET.value).decode().lower().rstrip("="),
        base64.b64encode(SECRET.value).decode(),
    ]
    for shown in (SECRET.fingerprint, repr(SECRET), str(SECRET)):
        for enc in encodings:
            assert enc[:12] not in shown


def test_derived_keys_differ_per_purpose_and_from_the_secret():
    a, b = SECRET.derive(b"one"), SECRET.derive(b"two")
    assert len(a) == len(b) == 32
    assert len({a, b, SECRET.value}) == 3


def test_secret_must_be_32_bytes():
    with pytest.raises(ValueError):
        MeshSecret(b"short")


def test_invite_round_trip_and_is_printable():
    invite = Invite(SECRET, ("127.0.0.1:7000", "[::1]:7001"), ("relay.example.org:443",))
    text = encode_invite(invite)
    assert text.startswith("meshinv1")
    assert text.isascii() and text.isalnum()
    assert decode_invite(text) == invite


addresses = st.lists(st.text(min_size=1, max_size=40), max_size=5).map(tuple)


@given(st.binary(min_size=32, max_size=32), addresses, addresses)
def test_invite_round_trip_property(secret, bootstrap, relays):
    invite = Invite(MeshSecret(secret), bootstrap, relays)
    assert decode_invite(encode_invite(invite)) == invite


def test_invite_tolerates_wrapping_dashes_and_case():
    text = encode_invite(Invite(SECRET, ("127.0.0.1:7000",)))
    wrapped = "  " + "-".join(text[i : i + 10] for i in range(0, len(text), 10)).upper() + "\n"
    assert decode_invite(wrapped).secret == SECRET


def test_every_single_character_typo_is_detected():
    text = encode_invite(Invite(SECRET, ("127.0.0.1:7000",)))
    body_start = len("meshinv1")
    for i in range(body_start, len(text)):
        typo = "a" if text[i] != "a" else "b"
        with pytest.raises(InviteError):
            decode_invite(text[:i] + typo + text[i + 1 :])


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda t: t[:-3], "truncated|checksum|copied"),
        (lambda t: t[:20], "truncated|checksum|copied"),
        (lambda t: t.replace("meshinv", "meshinx", 1), "not a meshagent invite"),
        (lambda t: "meshinv2" + t[8:], "version 2 is not supported"),
        (lambda t: "meshinv" + t[8:], "checksum|version|base32"),
        (lambda t: t[:12] + "1" + t[13:], "base32"),
        (lambda t: "", "not a meshagent invite"),
    ],
)
def test_corrupt_invites_raise_clear_errors(mangle, message):
    text = encode_invite(Invite(SECRET, ("127.0.0.1:7000",)))
    with pytest.raises(InviteError, match=message):
        decode_invite(mangle(text))


@given(st.text(max_size=200))
def test_arbitrary_text_raises_only_invite_error(text):
    with contextlib.suppress(InviteError):
        decode_invite(text)
