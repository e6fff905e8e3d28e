"""Webhook targets on private, loopback, link-local, CGNAT, ULA or metadata addresses are refused."""

from __future__ import annotations

import ipaddress

import pytest

from services.telemetry.webhooks.ssrf import AllowList, TargetRefused, parse_target, refusal, resolve_target


@pytest.mark.parametrize(("address", "reason"), [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("10.1.2.3", "private"), ("172.20.0.1", "private"),
    ("192.168.1.1", "private"), ("169.254.10.10", "link-local"), ("fe80::1", "link-local"),
    ("100.64.0.1", "cgnat"), ("fd12:3456::1", "ula"), ("169.254.169.254", "metadata"),
    ("fd00:ec2::254", "metadata"), ("100.100.100.200", "metadata"), ("0.0.0.0", "unspecified"),
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:169.254.169.254", "metadata"), ("64:ff9b::a00:1", "private"),
    ("224.0.0.1", "multicast"), ("2002:7f00:1::", "loopback"),
])
def test_non_public_addresses_are_refused(address: str, reason: str) -> None:
    assert refusal(ipaddress.ip_address(address)) == reason


# IPv6 forms that carry an IPv4 address (issue 43): each reaches the IPv4 host, so the IPv4 decides; the
# deprecated or local-only forms are refused whatever they carry.
@pytest.mark.parametrize(("address", "reason"), [
    ("::127.0.0.1", "loopback"),  # IPv4-compatible
    ("::10.0.0.1", "private"),
    ("::8.8.8.8", "ipv4-compatible"),  # deprecated: refused even with a public IPv4 inside
    ("::ffff:0:127.0.0.1", "loopback"),  # IPv4-translated (SIIT)
    ("::ffff:0:169.254.169.254", "metadata"),
    ("::ffff:0:8.8.8.8", "ipv4-translated"),
    ("::ffff:192.168.0.1", "private"),  # mapped
    ("64:ff9b::127.0.0.1", "loopback"),  # NAT64 well-known prefix
    ("64:ff9b::169.254.169.254", "metadata"),
    ("64:ff9b:1::10.0.0.1", "nat64-local"),  # NAT64 local-use prefix: refused whole
    ("64:ff9b:1::8.8.8.8", "nat64-local"),
    ("64:ff9b:1:a00:1::", "nat64-local"),  # local-use /64 form: IPv4 in the middle
    ("2002:a9fe:a9fe::1", "metadata"),  # 6to4 of 169.254.169.254
    ("2002:c0a8:101::", "private"),  # 6to4 of 192.168.1.1
    ("2001:0:4136:e378:8000:63bf:80ff:fffe", "loopback"),  # Teredo, client 127.0.0.1 obfuscated
    ("2001:0:a00:1::", "private"),  # Teredo server 10.0.0.1
])
def test_ipv6_forms_carrying_a_non_public_ipv4_are_refused(address: str, reason: str) -> None:
    assert refusal(ipaddress.ip_address(address)) == reason


@pytest.mark.parametrize("address", ["::ffff:8.8.8.8", "64:ff9b::8.8.8.8", "2002:808:808::1",
                                     "2001:0:4136:e378:8000:63bf:f7f7:f7f7"])
def test_ipv6_forms_carrying_a_public_ipv4_pass(address: str) -> None:
    assert refusal(ipaddress.ip_address(address)) is None


async def test_a_name_resolving_to_an_ipv6_form_of_a_private_ipv4_is_refused() -> None:
    """The check at delivery time judges what DNS answers, which may be any of the forms above."""
    for answer, reason in [("::7f00:1", "loopback"), ("::ffff:0:a9fe:a9fe", "metadata"),
                           ("64:ff9b:1::a00:1", "nat64-local"), ("2001:0:4136:e378:8000:63bf:80ff:fffe", "loopback")]:
        async def resolver(host: str, port: int, answer: str = answer) -> list[str]:
            return ["93.184.216.34", answer]

        with pytest.raises(TargetRefused) as err:
            await resolve_target("https://hooks.example.com/x", resolver=resolver)
        assert err.value.reason == reason, answer


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "100.128.0.1"])
def test_public_addresses_pass(address: str) -> None:
    assert refusal(ipaddress.ip_address(address)) is None


def test_allow_list_opens_exactly_its_networks() -> None:
    allow = AllowList.parse(["127.0.0.0/8", "10.0.5.0/24"])
    assert refusal(ipaddress.ip_address("127.0.0.1"), allow) is None
    assert refusal(ipaddress.ip_address("10.0.5.9"), allow) is None
    assert refusal(ipaddress.ip_address("10.0.6.9"), allow) == "private"
    assert refusal(ipaddress.ip_address("::1"), allow) == "loopback"


async def test_a_name_resolving_to_any_private_address_is_refused() -> None:
    async def rebinding(host: str, port: int) -> list[str]:
        return ["93.184.216.34", "169.254.169.254"]

    with pytest.raises(TargetRefused) as err:
        await resolve_target("https://hooks.example.com/x", resolver=rebinding)
    assert err.value.reason == "metadata"

    async def public(host: str, port: int) -> list[str]:
        return ["93.184.216.34"]

    target = await resolve_target("https://hooks.example.com:8443/x?a=1", resolver=public)
    assert target.url_for(target.addresses[0]) == "https://93.184.216.34:8443/x?a=1"
    assert target.host_header == "hooks.example.com:8443"


async def test_literal_addresses_and_bad_urls() -> None:
    with pytest.raises(TargetRefused) as err:
        await resolve_target("http://[::1]:8080/hook")
    assert err.value.reason == "loopback"
    for bad, reason in [("ftp://example.com/", "scheme"), ("http:///nohost", "no-host"),
                        ("http://user:pw@example.com/", "credentials")]:
        with pytest.raises(TargetRefused) as err:
            parse_target(bad)
        assert err.value.reason == reason
