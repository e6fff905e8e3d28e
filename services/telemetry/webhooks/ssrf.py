"""Where webhooks may go. A target URL is resolved, and every address it resolves to must be public:
loopback, private (RFC 1918), link-local, CGNAT (100.64/10), unique-local IPv6 (fc00::/7), cloud metadata
endpoints, multicast, documentation and reserved ranges are refused unless an allow-list network contains
the address. An IPv6 address that carries an IPv4 one (mapped, NAT64, 6to4, Teredo) is judged by that IPv4
address too; the deprecated or local-only forms (IPv4-compatible, IPv4-translated, local-use NAT64) are
refused whatever they carry. The check runs at subscription time and again before every attempt (DNS can change between
retries: a rebinding attack points a public name at 169.254.169.254 after the first check), and the
request then goes to the checked address itself, so no second resolution happens in the HTTP client.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from shared.settings import settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
ALLOW_ENV = "GPUQ_WEBHOOK_ALLOW_CIDRS"

# Most specific first: the first match names the reason.
_BLOCKED: tuple[tuple[str, str], ...] = (
    ("169.254.169.254/32", "metadata"),  # AWS/GCP/Azure/OpenStack instance metadata
    ("169.254.170.2/32", "metadata"),  # ECS task metadata
    ("100.100.100.200/32", "metadata"),  # Alibaba Cloud metadata
    ("fd00:ec2::254/128", "metadata"),  # AWS IPv6 metadata
    ("0.0.0.0/8", "unspecified"),
    ("127.0.0.0/8", "loopback"),
    ("10.0.0.0/8", "private"),
    ("172.16.0.0/12", "private"),
    ("192.168.0.0/16", "private"),
    ("100.64.0.0/10", "cgnat"),
    ("169.254.0.0/16", "link-local"),
    ("192.0.0.0/24", "reserved"),
    ("192.0.2.0/24", "reserved"),
    ("198.18.0.0/15", "reserved"),
    ("198.51.100.0/24", "reserved"),
    ("203.0.113.0/24", "reserved"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved"),
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("fc00::/7", "ula"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "private"),
    ("ff00::/8", "multicast"),
    ("2001:db8::/32", "reserved"),
    ("100::/64", "reserved"),
)
BLOCKED: tuple[tuple[IPNetwork, str], ...] = tuple((ipaddress.ip_network(n), r) for n, r in _BLOCKED)


class TargetRefused(ValueError):
    """The webhook target is not allowed; `reason` is a short machine code."""

    def __init__(self, reason: str, message: str):
        self.reason = reason
        super().__init__(message)


@dataclass(frozen=True)
class AllowList:
    """Networks that may be targeted although they are not public (e.g. an in-cluster receiver)."""

    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, cidrs: Iterable[str]) -> AllowList:
        return cls(tuple(ipaddress.ip_network(c.strip(), strict=False) for c in cidrs if c.strip()))

    @classmethod
    def from_env(cls) -> AllowList:
        return cls.parse(settings().webhook_allow_cidrs)

    def allows(self, ip: IPAddress) -> bool:
        return any(ip.version == n.version and ip in n for n in self.networks)


# IPv6 forms that reach an IPv4 host are judged by the IPv4 address inside them.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052 well-known prefix: DNS64 networks use it for public hosts
# Ranges no webhook receiver legitimately has, whatever IPv4 they carry: refused whole, under this reason
# (after the embedded IPv4's own reason, which says more when there is one).
_RETIRED: tuple[tuple[IPNetwork, str], ...] = (
    (ipaddress.ip_network("::/96"), "ipv4-compatible"),  # ::a.b.c.d, deprecated by RFC 4291
    (ipaddress.ip_network("::ffff:0:0:0/96"), "ipv4-translated"),  # ::ffff:0:a.b.c.d, SIIT-internal (RFC 2765)
    # RFC 8215 local-use NAT64: the operator's own translator; the IPv4 may sit anywhere in the suffix
    (ipaddress.ip_network("64:ff9b:1::/48"), "nat64-local"),
)
_SELF = (ipaddress.IPv6Address("::"), ipaddress.IPv6Address("::1"))  # in ::/96 but not IPv4-compatible forms


def _embedded_v4(ip: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, ...]:
    """IPv4 addresses hidden in an IPv6 one that can reach IPv4 hosts: mapped ::ffff:a.b.c.d, IPv4-compatible
    ::a.b.c.d, IPv4-translated ::ffff:0:a.b.c.d, NAT64 64:ff9b::/96, 6to4 2002::/16, and Teredo 2001::/32
    (its server and its de-obfuscated client). The local-use NAT64 prefix has no fixed place for it."""
    if ip.ipv4_mapped is not None:
        return (ip.ipv4_mapped,)
    if ip.sixtofour is not None:
        return (ip.sixtofour,)
    if ip.teredo is not None:
        return ip.teredo
    if ip in _SELF:
        return ()
    if ip in _NAT64 or any(ip in net for net, _ in _RETIRED[:2]):
        return (ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF),)
    return ()


def refusal(ip: IPAddress, allow: AllowList = AllowList()) -> str | None:
    """Why this address may not be targeted, or None if it may."""
    if allow.allows(ip):
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        for inner in _embedded_v4(ip):
            reason = refusal(inner, allow)
            if reason is not None:
                return reason
        for net, reason in _RETIRED:
            if ip in net and ip not in _SELF:
                return reason
    for net, reason in BLOCKED:
        if ip.version == net.version and ip in net:
            return reason
    return None


@dataclass(frozen=True)
class Target:
    url: str
    scheme: str
    host: str
    port: int
    path: str  # path + query, as sent
    addresses: tuple[IPAddress, ...] = field(default=())

    def url_for(self, ip: IPAddress) -> str:
        netloc = f"[{ip}]" if ip.version == 6 else str(ip)
        return f"{self.scheme}://{netloc}:{self.port}{self.path}"

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        name = f"[{self.host}]" if ":" in self.host else self.host
        return name if self.port == default else f"{name}:{self.port}"


def parse_target(url: str) -> Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise TargetRefused("scheme", f"webhook URL must be http or https, got {parts.scheme or 'none'!r}")
    if not parts.hostname:
        raise TargetRefused("no-host", f"webhook URL has no host: {url!r}")
    if parts.username or parts.password:
        raise TargetRefused("credentials", "webhook URL must not carry credentials")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise TargetRefused("port", f"bad port in {url!r}: {exc}") from None
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(url=url, scheme=parts.scheme, host=parts.hostname, port=port, path=path)


Resolver = Callable[[str, int], Awaitable[list[str]]]


async def system_resolver(host: str, port: int) -> list[str]:
    import asyncio

    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


async def resolve_target(url: str, allow: AllowList = AllowList(),
                         resolver: Resolver = system_resolver) -> Target:
    """Parse, resolve and check `url`; every resolved address must be allowed (a name that resolves
    to one public and one private address is refused: the client could pick either)."""
    target = parse_target(url)
    try:
        literal: IPAddress | None = ipaddress.ip_address(target.host)
    except ValueError:
        literal = None
    if literal is not None:
        raw = [str(literal)]
    else:
        try:
            raw = await resolver(target.host, target.port)
        except OSError as exc:
            raise TargetRefused("dns", f"cannot resolve {target.host}: {exc}") from None
    addresses: list[IPAddress] = []
    for a in raw:
        ip = ipaddress.ip_address(a.split("%", 1)[0])  # drop an IPv6 zone index
        if ip not in addresses:
            addresses.append(ip)
    if not addresses:
        raise TargetRefused("dns", f"{target.host} resolves to no address")
    for ip in addresses:
        reason = refusal(ip, allow)
        if reason is not None:
            raise TargetRefused(reason, f"webhook target {target.host} resolves to {ip} ({reason}); "
                                        f"add it to {ALLOW_ENV} to allow it")
    return Target(target.url, target.scheme, target.host, target.port, target.path, tuple(addresses))
