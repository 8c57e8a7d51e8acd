"""Encrypted records: the unit on the wire after the handshake.

    record = length (u32, big-endian) || AEAD(key, nonce, plaintext, aad=length)

The AEAD is the connection's negotiated record cipher (`wire/ciphers.py`: ChaCha20-Poly1305
or AES-256-GCM). `length` counts the ciphertext including its 16-byte tag. Each direction
has its own key (from the Noise split) and a 64-bit counter starting at 0; the nonce is 4
zero bytes followed by the counter (the cipher's Noise nonce layout). A counter value is
used once; the sealer refuses to wrap. The key rolls every REKEY_INTERVAL records on both
ends. A record that fails authentication ends the connection.
"""

from __future__ import annotations

import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from meshagent.wire.ciphers import (
    AESGCM_256,
    CHACHAPOLY,
    REKEY_INTERVAL,
    aead_for,
    nonce_packer,
    rekey,
)
from meshagent.wire.errors import ErrorCode, LocalUsageError, ProtocolError
from meshagent.wire.settings import MAX_RECORD_PLAINTEXT

TAG_LEN = 16
HEADER_LEN = 4
MAX_RECORD_CIPHERTEXT = MAX_RECORD_PLAINTEXT + TAG_LEN
_LEN = struct.Struct(">I")
_MAX_COUNTER = (1 << 64) - 1

# A record's plaintext: bytes-like, or a (head, body) pair to be concatenated.
Plaintext = bytes | bytearray | memoryview | tuple[bytes, bytes | memoryview]


# A (head, body) frame with a body at least this big is sealed without first being laid out
# in one buffer, where the cipher can be fed in pieces (AES-GCM): the copy would cost about a
# third as much as the encryption itself.
_PIECEWISE_MIN = 64 * 1024


class _Keys:
    """One direction's AEAD, nonce layout and key schedule."""

    def __init__(self, key: bytes, cipher: str, rekey_interval: int) -> None:
        self.cipher = cipher
        self.key = key
        self.aead = aead_for(cipher, key)
        self.nonce = nonce_packer(cipher).pack
        self.interval = rekey_interval
        self.block = algorithms.AES(key) if cipher == AESGCM_256 else None

    def roll(self) -> None:
        self.key = rekey(self.cipher, self.key)
        self.aead = aead_for(self.cipher, self.key)
        if self.block is not None:
            self.block = algorithms.AES(self.key)


def _seal_pieces(
    block: algorithms.AES,
    nonce: bytes,
    head: bytes,
    body: bytes | memoryview,
    aad: memoryview,
    out: memoryview,
) -> None:
    """AES-GCM of head || body into `out` (ciphertext then tag), feeding the two pieces in
    turn: the same record `AESGCM.encrypt` makes of their concatenation."""
    enc = Cipher(block, modes.GCM(nonce)).encryptor()
    enc.authenticate_additional_data(aad)
    # update_into wants room for a block - 1 more than it is given; the tag's 16 bytes
    # after the ciphertext provide it.
    n = enc.update_into(head, out)
    n += enc.update_into(body, out[n:])
    enc.finalize()
    out[n : n + TAG_LEN] = enc.tag


class RecordSealer:
    """Encrypts plaintexts into records, one nonce per record, in order."""

    def __init__(
        self, key: bytes, cipher: str = CHACHAPOLY, *, rekey_interval: int = REKEY_INTERVAL
    ) -> None:
        self._keys = _Keys(key, cipher, rekey_interval)
        self._counter = 0
        self._scratch = memoryview(bytearray())

    @property
    def records_sealed(self) -> int:
        return self._counter

    @staticmethod
    def sealed_size(frames: list[Plaintext]) -> int:
        """Bytes that `seal_into` writes for `frames`."""
        total = len(frames) * (HEADER_LEN + TAG_LEN)
        for f in frames:
            total += len(f) if type(f) is not tuple else len(f[0]) + len(f[1])
        return total

    def seal_into(self, frames: list[Plaintext], out: bytearray) -> int:
        """Seal one record per frame into `out` (at least `sealed_size(frames)` long) from
        offset 0, returning the bytes written. A frame is bytes-like, or a (head, body) pair
        of bytes-likes whose concatenation is the plaintext: under AES-GCM a body of
        `_PIECEWISE_MIN` bytes or more is encrypted straight from where it lies, head then
        body; otherwise the pair is laid out in a scratch buffer (the one copy its body gets)
        and encrypted from there."""
        view = memoryview(out)
        pos = 0
        keys = self._keys
        aead, nonce_of, interval = keys.aead, keys.nonce, keys.interval
        for frame in frames:
            pair = type(frame) is tuple
            size = len(frame[0]) + len(frame[1]) if pair else len(frame)
            if size > MAX_RECORD_PLAINTEXT:
                raise LocalUsageError(f"record of {size} bytes exceeds {MAX_RECORD_PLAINTEXT}")
            if self._counter >= _MAX_COUNTER:
                raise LocalUsageError("record counter exhausted; open a new connection")
            _LEN.pack_into(out, pos, size + TAG_LEN)
            counter = self._counter
            if counter and counter % interval == 0:
                keys.roll()
                aead = keys.aead
            nonce = nonce_of(counter)
            self._counter = counter + 1
            end = pos + HEADER_LEN + size + TAG_LEN
            aad, sealed = view[pos : pos + HEADER_LEN], view[pos + HEADER_LEN : end]
            pos = end
            if pair:
                head, body = frame
                if keys.block is not None and len(body) >= _PIECEWISE_MIN:
                    _seal_pieces(keys.block, nonce, head, body, aad, sealed)
                    continue
                plaintext = self._scratch_for(size)[:size]
                plaintext[: len(head)] = head
                plaintext[len(head) :] = body
            else:
                plaintext = frame
            aead.encrypt_into(nonce, plaintext, aad, sealed)
        return pos

    def _scratch_for(self, size: int) -> memoryview:
        if len(self._scratch) < size:
            self._scratch = memoryview(bytearray(max(size, 64 * 1024)))
        return self._scratch

    def seal_many(self, plaintexts: list[Plaintext]) -> bytearray:
        """All records for `plaintexts`, concatenated into one buffer for a single write."""
        out = bytearray(self.sealed_size(plaintexts))
        self.seal_into(plaintexts, out)
        return out

    def seal(self, plaintext: bytes) -> bytes:
        return bytes(self.seal_many([plaintext]))


class RecordReader:
    """Pure state machine: feed received bytes, take decrypted plaintexts out in order.

    Bytes come in either with `receive_data(data)` or, without that copy, by filling
    `writable(size)` (e.g. with `socket.recv_into`) and then calling `written(n)`. The
    buffer is kept and reused; it grows only to hold one whole record (or one read).

    Raises only ProtocolError: on a length outside 1..MAX (checked before buffering the body,
    so an oversized claim costs no memory) or on a record that fails authentication.
    """

    def __init__(
        self,
        key: bytes,
        cipher: str = CHACHAPOLY,
        *,
        max_plaintext: int = MAX_RECORD_PLAINTEXT,
        rekey_interval: int = REKEY_INTERVAL,
    ) -> None:
        self._keys = _Keys(key, cipher, rekey_interval)
        self._counter = 0
        self._buffer = bytearray()
        self._start = 0  # unread bytes are self._buffer[self._start : self._end]
        self._end = 0
        self._max_ciphertext = max_plaintext + TAG_LEN
        self._failed: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        return self._end - self._start

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        while view:
            room = self.writable(len(view))
            n = min(len(room), len(view))
            room[:n] = view[:n]
            self.written(n)
            view = view[n:]

    def writable(self, size: int) -> memoryview:
        """Room for the next bytes: exactly the rest of the record being received when its
        length is known, else `size` bytes. A read into it never runs past a record's end, so
        once the whole records are taken the buffer starts empty again and no partial record
        is ever moved (a copy of nearly every byte when records are as big as reads). Fill a
        prefix, then call `written` with its length before any other call."""
        if self._failed is not None:
            raise self._failed
        buf, start, end = self._buffer, self._start, self._end
        live = end - start
        if live >= HEADER_LEN:
            (length,) = _LEN.unpack_from(buf, start)
            rest = HEADER_LEN + length - live
            if length <= self._max_ciphertext and rest > 0:  # else next_record acts first
                size = rest
        if len(buf) - end < size:
            if live + size > len(buf):
                # Replace rather than resize: the caller may still hold a view of the old one.
                new = bytearray(max(live + size, 2 * len(buf)))
                new[:live] = memoryview(buf)[start:end]
                self._buffer = buf = new
            elif live:
                view = memoryview(buf)
                view[:live] = view[start:end]  # at most one partial record
                view.release()
            self._start, self._end = 0, live
            end = live
        return memoryview(buf)[end : end + size]

    def written(self, n: int) -> None:
        """`n` bytes were placed at the start of the last `writable` buffer."""
        if not 0 <= n <= len(self._buffer) - self._end:
            raise ValueError(f"wrote {n} bytes into a buffer of {len(self._buffer) - self._end}")
        self._end += n

    def next_record(self) -> bytearray | None:
        """The next plaintext, or None when more bytes are needed. The caller owns the
        returned buffer (it may trim it in place, as the frame decoder does for DATA)."""
        if self._failed is not None:
            raise self._failed
        buf, start = self._buffer, self._start
        if self._end - start < HEADER_LEN:
            return None
        (length,) = _LEN.unpack_from(buf, start)
        if length > self._max_ciphertext:
            self._fail(
                f"record of {length} bytes exceeds the maximum {self._max_ciphertext}",
                ErrorCode.FRAME_TOO_LARGE,
            )
        if length < TAG_LEN:
            self._fail(f"record of {length} bytes is shorter than its tag")
        body = start + HEADER_LEN
        end = body + length
        if self._end < end:
            return None
        plaintext = bytearray(length - TAG_LEN)
        view = memoryview(buf)
        keys, counter = self._keys, self._counter
        if counter and counter % keys.interval == 0:
            keys.roll()
        try:
            keys.aead.decrypt_into(keys.nonce(counter), view[body:end], view[start:body], plaintext)
        except InvalidTag:
            self._fail(
                "record failed authentication (tampered, replayed, reordered or plaintext data)"
            )
        finally:
            view.release()
        self._counter += 1
        if end == self._end:
            self._start = self._end = 0
        else:
            self._start = end
        return plaintext

    def _fail(self, message: str, code: ErrorCode = ErrorCode.PROTOCOL_ERROR) -> None:
        self._failed = ProtocolError(message, code)
        raise self._failed
