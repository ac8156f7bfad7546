"""Which addresses an image URL may reach: public ones only, unless private networks are allowed.

The check lives in the resolver the HTTP connector uses, so the address that was checked is the
address that is connected to: a hostname cannot resolve to a public address for the check and to
127.0.0.1 for the connection (DNS rebinding). Every redirect hop goes through the same resolver.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

__all__ = ["AddressRefused", "CheckingResolver", "StaticResolver", "is_public_address"]


class AddressRefused(OSError):
    """A hostname resolved to an address the policy does not allow."""


def is_public_address(address: str) -> bool:
    """False for private, loopback, link-local, multicast, reserved and unspecified addresses."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    refused = ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_reserved
    refused = refused or ip.is_unspecified or (isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local)
    return not refused


class CheckingResolver(AbstractResolver):
    """Resolves through ``inner`` and refuses the whole answer if any address is not allowed."""

    def __init__(self, *, allow_private: bool, inner: AbstractResolver | None = None) -> None:
        self.allow_private = allow_private
        self.inner = inner or DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self.inner.resolve(host, port, family)
        if not self.allow_private:
            refused = [r["host"] for r in results if not is_public_address(r["host"])]
            if refused:
                raise AddressRefused(
                    f"{host} resolves to {refused[0]}, a private or local address, which is not allowed"
                )
        return results

    async def close(self) -> None:
        await self.inner.close()


class StaticResolver(AbstractResolver):
    """Answers from a fixed table (tests, and hosts pinned by configuration)."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table

    async def resolve(self, host: str, port: int = 0, family: Any = socket.AF_INET) -> list[ResolveResult]:
        if host not in self.table:
            raise OSError(f"cannot resolve {host}")
        return [
            ResolveResult(
                hostname=host,
                host=address,
                port=port,
                family=socket.AF_INET6 if ":" in address else socket.AF_INET,
                proto=0,
                flags=socket.AI_NUMERICHOST,
            )
            for address in self.table[host]
        ]

    async def close(self) -> None:
        return None
