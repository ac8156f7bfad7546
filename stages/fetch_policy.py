"""Which addresses an image URL may reach, and the resolver that enforces it at connect time.

The check lives inside the resolver the HTTP connector uses (``PinnedResolver``), so the lookup that
is checked is the lookup that is connected to: a hostname cannot answer a public address to the
check and 127.0.0.1 to the connection (DNS rebinding). Every redirect hop goes through the same
resolver. aiohttp skips the resolver for IP literals, so ``FetchStage`` checks those itself with
``AddressPolicy.check_literal``.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio
from aiohttp.abc import AbstractResolver, ResolveResult

__all__ = ["AddressPolicy", "AddressRefused", "PinnedResolver", "Resolver", "SystemResolver"]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class AddressRefused(OSError):
    """A URL's host is, or resolves to, an address the policy does not allow."""


class Resolver(Protocol):
    """Turns a hostname into the IP address strings it resolves to."""

    async def resolve(self, host: str, port: int) -> list[str]: ...


class SystemResolver:
    """The operating system's resolver (``getaddrinfo`` in a worker thread)."""

    async def resolve(self, host: str, port: int) -> list[str]:
        """The addresses of ``host``; :raises OSError: when it does not resolve."""
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return list(dict.fromkeys(str(sockaddr[0]) for *_, sockaddr in infos))


@dataclass(frozen=True, slots=True)
class AddressPolicy:
    """Public addresses only, unless ``allow_private``; ``allowed_networks`` are let through anyway."""

    allow_private: bool = False
    allowed_networks: tuple[IPNetwork, ...] = ()  # e.g. an internal image CDN

    def is_allowed(self, address: str) -> bool:
        """Whether a connection to ``address`` is allowed; :raises ValueError: not an IP address."""
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone ("fe80::1%eth0")
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 reaches 127.0.0.1
        if self.allow_private or any(ip in net for net in self.allowed_networks):
            return True
        local = ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
        # is_global also refuses shared (100.64/10) and documentation ranges
        return ip.is_global and not (local or ip.is_reserved or ip.is_unspecified)

    def check(self, host: str, addresses: Sequence[str]) -> None:
        """Refuse the whole answer if any address is not allowed; :raises AddressRefused:."""
        for address in addresses:
            if not self.is_allowed(address):
                shown = host if host == address else f"{host} ({address})"
                raise AddressRefused(f"address {shown} is private or local, which is not allowed")

    def check_literal(self, host: str) -> None:
        """Check a URL host that aiohttp will connect to without resolving; :raises AddressRefused:."""
        # aiohttp's own test for "this is an IP literal": it bypasses the resolver for these
        if ":" not in host and not host.replace(".", "").isdigit():
            return
        try:
            self.check(host, [host])
        except ValueError:
            raise AddressRefused(f"address {host} is not a canonical IP address, which is not allowed") from None


class PinnedResolver(AbstractResolver):
    """The connector's resolver: resolves with ``resolver`` and checks every answer with ``policy``."""

    def __init__(self, resolver: Resolver, policy: AddressPolicy) -> None:
        self.resolver = resolver
        self.policy = policy

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        """Checked addresses of ``host``; :raises AddressRefused: :raises OSError: no address."""
        addresses = await self.resolver.resolve(host, port)
        self.policy.check(host, addresses)
        results = [
            ResolveResult(
                hostname=host,
                host=address,
                port=port,
                family=socket.AF_INET6 if ":" in address else socket.AF_INET,
                proto=0,
                flags=socket.AI_NUMERICHOST,  # connect to exactly this address, no second lookup
            )
            for address in addresses
        ]
        results = [r for r in results if family == socket.AF_UNSPEC or r["family"] == family]
        if not results:
            raise OSError(f"{host} has no usable address")
        return results

    async def close(self) -> None:
        return None
