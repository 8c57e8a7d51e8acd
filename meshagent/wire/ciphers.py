"""Record ciphers: which AEAD seals the records of a connection, and how its keys roll.

Two ciphers, both 256-bit keys from the Noise split, both with 96-bit nonces of 4 zero bytes
and a 64-bit record counter (the layouts of Noise's ChaChaPoly and AESGCM):
  * "chachapoly": ChaCha20-Poly1305, counter little-endian. Every peer speaks it; it is the
    fallback and the choice when either side lacks fast AES.
  * "aesgcm": AES-256-GCM, counter big-endian. Offered only by a peer on which it measured
    faster than ChaCha20-Poly1305 (AES instructions): there it costs a third as much per
    byte, which is what lets the overlay keep up with loopback TCP (docs/benchmarks.md).

The initiator offers its list in handshake message 1 (in its order of preference); the
responder picks the first one it also offers and names it in message 2. Both messages are
covered by the handshake hash, so a choice cannot be downgraded by anyone outside the mesh.

Keys roll every REKEY_INTERVAL records in each direction, without a message: both ends count
records, and the new key is Noise's REKEY of the old one (encrypt 32 zero bytes under the
reserved nonce 2**64-1, keep the first 32 bytes). That bounds the data any one AES-GCM key
protects to 2**20 records (at most 1 TiB, far inside the cipher's limits).
"""

from __future__ import annotations

import functools
import struct
import time

from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

CHACHAPOLY = "chachapoly"
AESGCM_256 = "aesgcm"
CIPHERS = (CHACHAPOLY, AESGCM_256)
REKEY_INTERVAL = 1 << 20
_NONCE_LE = struct.Struct("<4xQ")
_NONCE_BE = struct.Struct(">4xQ")
_MAX_NONCE = (1 << 64) - 1


def aead_for(cipher: str, key: bytes) -> ChaCha20Poly1305 | AESGCM:
    if cipher == CHACHAPOLY:
        return ChaCha20Poly1305(key)
    if cipher == AESGCM_256:
        return AESGCM(key)
    raise ValueError(f"unknown record cipher {cipher!r}")


def nonce_packer(cipher: str) -> struct.Struct:
    """The struct whose `pack(counter)` gives the cipher's 12-byte nonce."""
    return _NONCE_BE if cipher == AESGCM_256 else _NONCE_LE


def rekey(cipher: str, key: bytes) -> bytes:
    """Noise's REKEY: the next key of a direction, derived from the current one."""
    nonce = nonce_packer(cipher).pack(_MAX_NONCE)
    return aead_for(cipher, key).encrypt(nonce, bytes(32), b"")[:32]


def choose(offered: list[object], supported: tuple[str, ...]) -> str:
    """The responder's pick: the first cipher the initiator offered that we support, else
    ChaCha20-Poly1305 (an initiator that offers nothing predates negotiation)."""
    for name in offered:
        if name in supported:
            return name  # type: ignore[return-value]
    return CHACHAPOLY


@functools.cache
def preferred() -> tuple[str, ...]:
    """The ciphers this machine offers, fastest first. AES-256-GCM is offered only when it
    measures clearly faster here than ChaCha20-Poly1305 (about a millisecond, once). The two
    are timed in turns and each keeps its best time, so a burst of load on a busy machine
    slows both alike rather than deciding the choice."""
    block = bytes(64 * 1024)
    nonce = bytes(12)
    key = bytes(32)
    aes, chacha = AESGCM(key), ChaCha20Poly1305(key)
    best = {aes: float("inf"), chacha: float("inf")}
    for _ in range(9):
        for aead in best:
            start = time.perf_counter()
            aead.encrypt(nonce, block, b"")
            best[aead] = min(best[aead], time.perf_counter() - start)
    if best[aes] * 1.5 < best[chacha]:
        return (AESGCM_256, CHACHAPOLY)
    return (CHACHAPOLY,)
