"""Whether the NATS server a process is pointed at lets anyone in without credentials.

On such a server every client can publish any fact (a forged JobCompleted or JobCancelled is believed: docs/security.md,
"What is still trusted"), so a process that finds one says so loudly: a WARNING in its log at start, and `nats_auth`
in the warnings of its /readyz report (readiness does not depend on it: a development NATS is a legitimate choice).

The probe is what an attacker would do: connect with the process's URL stripped of its credentials. A server with
users refuses it ("Authorization Violation"); one without lets it in.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import nats

log = logging.getLogger("gpuq.busauth")

PROBE_TIMEOUT_S = 2.0
WARNING_KEY = "nats_auth"  # the key of the warning in /readyz


@dataclass(frozen=True)
class BusAuth:
    """`anonymous`: True if the server accepted a client without credentials, False if it refused one, None if the
    probe could not tell (the server did not answer)."""

    anonymous: bool | None
    detail: str

    @property
    def warning(self) -> str | None:
        return self.detail if self.anonymous else None


def without_credentials(nats_url: str) -> list[str]:
    """The servers of a NATS_URL (comma-separated, as nats-py takes it) without their user:password or token."""
    servers = []
    for url in (u.strip() for u in nats_url.split(",")):
        if not url:
            continue
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        servers.append(urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])))
    return servers


async def probe(nats_url: str, timeout_s: float = PROBE_TIMEOUT_S) -> BusAuth:
    servers = without_credentials(nats_url)
    where = ", ".join(servers)

    async def quiet(exc: Exception) -> None:  # nats-py would log the expected refusal as an error
        pass

    try:
        # max_reconnect_attempts=0 would make nats-py try an unreachable server for ever; the bound is for the rest.
        nc = await asyncio.wait_for(nats.connect(servers=servers, allow_reconnect=False, max_reconnect_attempts=1,
                                                 connect_timeout=timeout_s, error_cb=quiet), 3 * timeout_s)
    except nats.errors.Error as exc:
        text = str(exc).lower()
        if "authorization" in text or "authentication" in text:
            return BusAuth(False, f"{where} refuses clients without credentials")
        return BusAuth(None, f"could not tell whether {where} requires credentials: {exc}")
    except Exception as exc:
        return BusAuth(None, f"could not tell whether {where} requires credentials: {type(exc).__name__}: {exc}")
    await nc.close()
    return BusAuth(True, f"NATS at {where} accepts clients without credentials: anyone who can reach it can publish "
                         "any fact (a job completed, cancelled, placed) and the services believe it. Use bus users "
                         "(`gpuq nats-auth`, the chart's natsAuth; docs/security.md)")


async def check_and_warn(nats_url: str) -> BusAuth:
    """Probe, and log a WARNING when the server takes anonymous clients (once per process start)."""
    found = await probe(nats_url)
    if found.anonymous:
        log.warning("INSECURE BUS: %s", found.detail)
    elif found.anonymous is None:
        log.info("%s", found.detail)
    return found
