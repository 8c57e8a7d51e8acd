"""Capture every frame seen in the current network namespace into a file, until SIGTERM.

Run inside a namespace (`ip netns exec NS python sniff.py OUT`); needs root (AF_PACKET).
Prints `ready` once capturing. The file holds `u32 length || frame` records.
"""

from __future__ import annotations

import signal
import socket
import sys

ETH_P_ALL = 0x0003


def main(path: str) -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.settimeout(0.1)
    with open(path, "wb") as out:
        print("ready", flush=True)
        while not stop:
            try:
                frame = sock.recv(1 << 18)
            except TimeoutError:
                continue
            out.write(len(frame).to_bytes(4, "big") + frame)


if __name__ == "__main__":
    main(sys.argv[1])
