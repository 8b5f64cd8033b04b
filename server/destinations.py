"""Where a person's webhook may post: never this server's own machine or network unless an admin
allows it (Settings.webhook_allow).

Checked twice: when a rule is saved (a URL that does not parse, or that names an internal address
in any spelling: 127.0.0.1, 0x7f000001, 2130706433, [::ffff:127.0.0.1], localhost), and again when
an alert is sent, on the addresses its host name resolves to then, so a name that later resolves to
an internal address is refused too. The sender connects to the address checked here (pinned), not
to whatever a second lookup would answer.
"""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Optional, Union
from urllib.parse import urlsplit

Address = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
INTERNAL_NAMES = ("localhost", "localhost.localdomain", "metadata", "metadata.google.internal")
HOW_TO_ALLOW = "an admin may allow it with TOKENPULSE_WEBHOOK_ALLOW (hosts or networks)"


class Refused(ValueError):
    """A destination this server will not post to; the message says why."""


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str  # as written (lower case, no brackets)
    port: int


def parse(url: str) -> Target:
    """The scheme, host and port of an http(s) URL; Refused when it does not parse."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a port that is not a number in 0..65535
        host = parts.hostname
    except ValueError as e:
        raise Refused(f"not a usable URL: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise Refused("must start with http:// or https://")
    if not host:
        raise Refused("names no host")
    if any(ord(c) < 33 or c in "\\" for c in host):
        raise Refused("its host holds a space, a control character or a backslash")
    return Target(parts.scheme, host.lower().rstrip("."), port or (443 if parts.scheme == "https" else 80))


def literal_address(host: str) -> Optional[Address]:
    """The address a host written as a number means, in every form a resolver accepts (0x7f000001,
    2130706433, 127.1, 0177.0.0.1, ::ffff:7f00:1); None for a name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if host and all(c in "0123456789abcdefx." for c in host) and any(c.isdigit() for c in host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))  # the C library's reading: what connect() would use
        except OSError:
            return None
    return None


def internal(addr: Address) -> bool:
    """Loopback, private, link-local (cloud metadata), unique-local, multicast, reserved, unspecified:
    anything not on the public internet. An IPv4 address inside IPv6 is judged as IPv4."""
    if isinstance(addr, ipaddress.IPv6Address):
        inner = addr.ipv4_mapped or addr.sixtofour or (addr.teredo[1] if addr.teredo else None)
        if inner is not None and internal(inner):
            return True
    return not addr.is_global or addr.is_multicast


class Policy:
    """The admin's allowlist: host names (exact) and networks."""

    def __init__(self, allow: list[str]):
        self.hosts: set[str] = set()
        self.networks: list = []
        for item in allow:
            item = item.strip().lower()
            try:
                self.networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                if item:
                    self.hosts.add(item.rstrip("."))

    def allows_host(self, host: str) -> bool:
        return host in self.hosts

    def allows_address(self, addr: Address) -> bool:
        return any(addr in n for n in self.networks) or not internal(addr)

    def check_url(self, url: str) -> Target:
        """At save time: the URL parses and does not name an internal host. Refused says why."""
        target = parse(url)
        if self.allows_host(target.host):
            return target
        if target.host in INTERNAL_NAMES or target.host.endswith((".localhost", ".internal")):
            raise Refused(f"{target.host} is this server's own machine or network; {HOW_TO_ALLOW}")
        addr = literal_address(target.host)
        if addr is not None and not self.allows_address(addr):
            raise Refused(f"{addr} is a loopback, private, link-local or otherwise internal address; {HOW_TO_ALLOW}")
        return target

    def checked_addresses(self, target: Target, resolved: list[str]) -> str:
        """At send time: the address to connect to, of those the host resolved to; Refused if any is
        internal (a name pointing at both is as suspect as one pointing inside)."""
        if not resolved:
            raise Refused(f"{target.host} does not resolve")
        if self.allows_host(target.host):
            return resolved[0]
        for raw in resolved:
            addr = ipaddress.ip_address(raw.split("%")[0])
            if not self.allows_address(addr):
                raise Refused(f"{target.host} resolves to {addr}, an internal address; {HOW_TO_ALLOW}")
        return resolved[0]
