"""Overlay addresses: `host:port` (IPv6 hosts in brackets)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from meshagent.errors import ConfigError


@dataclass(frozen=True, order=True)
class Address:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str | Address) -> Address:
        if isinstance(text, Address):
            return text
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ConfigError(f"address {text!r} is not host:port (port 0-65535)")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        return cls(host, int(port))

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def is_loopback(host: str) -> bool:
    """Whether an address to bind (or a name) reaches this machine only."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
