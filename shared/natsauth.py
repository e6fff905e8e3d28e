"""Bus identity: NATS users with subject permissions, one per service, per team and for admins (docs/security.md).

The server configuration lists users with bcrypt-hashed passwords and, for each, the subjects it may publish and
subscribe to. Each internal subject is granted to the one service that owns it (JobPlaced to the scheduler,
JobCompleted to the executors, QueueConfigChanged to admins and the API, ...); a team's producer credential may
publish only `<ns>.job.submitted.<team>` and `<ns>.job.cancel_requested.<team>`, and subscribe only to its own
reply inbox (`_INBOX_<user>.>`: a shared `_INBOX.>` would let it read what other clients are delivered).
Of the JetStream API, each service gets exactly what it uses: its own durable consumers (create, inspect, pull, ack;
named `<service>-<stream pattern>`, shared/bus.py), the streams it publishes to or consumes from (inspect, create
when missing), and updates only of the streams it owns; so a leaked credential, even telemetry's, can neither drain
another service's consumer nor change (shrink) a stream.

Why users in the server configuration rather than accounts with nkeys/JWT: it works unchanged on NATS 2.9 and
newer, needs no operator, resolver or account server, and one platform is one trust domain (platforms that share a
server are kept apart by namespace, and by these per-namespace permissions). Credentials travel as the user:password
of a `nats://` URL, which every gpuq component already takes (NATS_URL); rotation is a new password in the
configuration and a server reload.

Everything here is plain data and text: `gpuq nats-auth` writes it for operators, the embedded server uses it for
`gpuq up`, `make demo` and `make test`.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import bcrypt
import yaml

from shared import namespace as namespaces
from shared.bus import StreamDef, pattern_name, streams
from shared.busroles import (
    ADMIN,
    KUBE,
    SERVICE_PUBLISHES,
    SERVICES,
    TEAM_PREFIX,
    _consumed,
    _published,
    _role,
    inbox_prefix,
    stream_rights,
    with_credentials,
)

# (who is who on the bus moved to shared/busroles.py; these stay importable from here)
from shared.busroles import KUBE_RECORDS_AS as KUBE_RECORDS_AS
from shared.busroles import SERVICE_CONSUMES as SERVICE_CONSUMES
from shared.busroles import inbox_prefix_for as inbox_prefix_for
from shared.busroles import redact_url as redact_url
from shared.busroles import url_user as url_user

USER_RE = re.compile(r"^[a-z0-9]([a-z0-9_-]{0,62}[a-z0-9])?$")
SERVER_CONFIG_FILE = "nats-auth.conf"  # the server's part: users, bcrypt hashes, permissions
SERVER_SECRET_SUFFIX = "server-auth"  # its Kubernetes Secret: <prefix>server-auth

class NatsAuthError(ValueError):
    pass


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def team_user(team: str) -> str:
    user = TEAM_PREFIX + team
    if not USER_RE.match(user):
        raise NatsAuthError(f"team {team!r} cannot have a bus credential: a team name on the bus is lower-case "
                            "letters, digits, '-' or '_' (no '.')")
    return user


# `admission_suffixes` entry for a development server: admission may use any consumer of the streams it reads, so
# that per-cohort instances started later (`gpuq up --admission-cohorts`, sharing the first one's embedded server)
# find theirs. Never in what `gpuq nats-auth` writes.
ANY_ADMISSION_SHARD = "*"


def durables(user: str, ns: str, stream: StreamDef, admission_suffixes: Iterable[str] = ()) -> list[str]:
    """The durable consumers a service's bus user reads on `stream` (admission: also per cohort set served)."""
    role = _role(user)
    if role is None:
        return []
    suffixes = ["", *sorted(set(admission_suffixes))] if role == "admission" else [""]
    return [ANY_ADMISSION_SHARD if suffix == ANY_ADMISSION_SHARD else f"{role}{suffix}-{pattern_name(p)}"
            for p in _consumed(user) for suffix in suffixes if f"{ns}.{p}" in stream.subjects]


def _jetstream_client(user: str, ns: str, admission_suffixes: Iterable[str] = ()) -> list[str]:
    """What a service needs of the JetStream API, and nothing more: inspect and create the streams it uses, update
    those it owns; create, inspect and pull its own durable consumers, and ack their messages. (No purge, no delete,
    no message get; no other service's consumer, no ephemeral consumer.)"""
    subjects = ["$JS.API.INFO"]
    for stream in streams(ns):
        rights = stream_rights(user, ns, stream)
        if rights is None:
            continue
        s = stream.name
        subjects += [f"$JS.API.STREAM.INFO.{s}", f"$JS.API.STREAM.CREATE.{s}"]
        if rights == "update":
            subjects.append(f"$JS.API.STREAM.UPDATE.{s}")
        for d in durables(user, ns, stream, admission_suffixes):
            # CREATE.<stream>.<durable>[.<filter>] (NATS >= 2.9, a consumer's filter updated in place) and the older
            # DURABLE.CREATE form nats-py uses for a new durable.
            subjects += [f"$JS.API.CONSUMER.CREATE.{s}.{d}", f"$JS.API.CONSUMER.CREATE.{s}.{d}.>",
                         f"$JS.API.CONSUMER.DURABLE.CREATE.{s}.{d}", f"$JS.API.CONSUMER.INFO.{s}.{d}",
                         f"$JS.API.CONSUMER.MSG.NEXT.{s}.{d}", f"$JS.ACK.{s}.{d}.>"]
    return subjects


def permissions(user: str, ns: str, *, kube_teams: Iterable[str] | None = None,
                admission_suffixes: Iterable[str] = ()) -> Permissions:
    """The permissions of one bus user in platform namespace `ns`. `admission_suffixes`: the consumer suffixes of
    admission instances that serve some cohorts (services/admission/sharding.py), whose durables admission may use
    besides its own."""
    ns = namespaces.validate(ns)
    inbox = (f"{inbox_prefix(user)}.>",)
    if user == ADMIN:
        return Permissions(publish=(">",), subscribe=(">",))
    if user.startswith(TEAM_PREFIX) and user not in SERVICE_PUBLISHES:
        team = user.removeprefix(TEAM_PREFIX)
        # A team's jobs also report their own throughput (MFU), on their team's subject.
        return Permissions(publish=(f"{ns}.job.submitted.{team}", f"{ns}.job.cancel_requested.{team}",
                                    f"{ns}.utilization.flops_reported.{team}"), subscribe=inbox)
    if _role(user) is None:
        raise NatsAuthError(f"unknown bus user {user!r}: one of {', '.join((*SERVICES, KUBE, ADMIN))} or "
                            f"{TEAM_PREFIX}<team>")
    publish = _published(user, ns, kube_teams)
    return Permissions(publish=tuple(publish + _jetstream_client(user, ns, admission_suffixes)), subscribe=inbox)


@dataclass
class AuthBundle:
    """Passwords (kept by their users) and the server configuration that holds only their bcrypt hashes."""

    namespace: str
    passwords: dict[str, str]
    server_config: str
    kube_teams: tuple[str, ...] | None = None
    users: tuple[str, ...] = field(default_factory=tuple)

    def url(self, base_url: str, user: str) -> str:
        return with_credentials(base_url, user, self.passwords[user])


def users_for(teams: Iterable[str]) -> list[str]:
    return [*SERVICES, KUBE, ADMIN, *sorted({team_user(t) for t in teams})]


def generate(ns: str, teams: Iterable[str], *, kube_teams: Iterable[str] | None = None, bcrypt_cost: int = 11,
             passwords: Mapping[str, str] | None = None, admission_suffixes: Iterable[str] = ()) -> AuthBundle:
    """New credentials for every service, the Kubernetes executor, admins and each team; `passwords` keeps the
    ones given (a rotation changes only the users left out). `bcrypt_cost` 11 for servers that live; the embedded
    servers of tests use a low cost so that hundreds of connections stay cheap. `admission_suffixes`: the consumer
    suffixes of per-cohort admission instances (`gpuq nats-auth --admission-cohorts`)."""
    users = users_for(teams)
    chosen = {u: (passwords or {}).get(u) or secrets.token_urlsafe(24) for u in users}
    kube = tuple(sorted(kube_teams)) if kube_teams is not None else None
    suffixes = tuple(sorted(set(admission_suffixes)))
    users_conf = []
    for user in users:
        perms = permissions(user, ns, kube_teams=kube, admission_suffixes=suffixes)
        hashed = bcrypt.hashpw(chosen[user].encode(), bcrypt.gensalt(rounds=bcrypt_cost, prefix=b"2a")).decode()
        users_conf.append({"user": user, "password": hashed,
                           "permissions": {"publish": {"allow": list(perms.publish)},
                                           "subscribe": {"allow": list(perms.subscribe)}}})
    # The NATS configuration format reads JSON.
    config = (f"# gpuq bus users for namespace {ns} (generated; the passwords are bcrypt hashes)\n"
              + json.dumps({"authorization": {"users": users_conf}}, indent=1) + "\n")
    return AuthBundle(namespace=ns, passwords=chosen, server_config=config, kube_teams=kube, users=tuple(users))


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (0600), whatever the umask, also when it already existed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def write_bundle(bundle: AuthBundle, directory: Path, base_url: str | None = None) -> list[Path]:
    """`nats-auth.conf` for the server (include it from its configuration) and `credentials.json` (user ->
    password, and URL when `base_url` is given) for the platform's processes. Both 0600."""
    config = directory / SERVER_CONFIG_FILE
    write_private(config, bundle.server_config)
    creds = {u: {"password": p, **({"url": bundle.url(base_url, u)} if base_url else {})}
             for u, p in sorted(bundle.passwords.items())}
    cred_file = directory / "credentials.json"
    write_private(cred_file, json.dumps({"namespace": bundle.namespace, "users": creds}, indent=2))
    return [config, cred_file]


def kube_secrets(bundle: AuthBundle, base_url: str, *, prefix: str = "gpuq-nats-",
                 namespace: str | None = None) -> str:
    """Kubernetes Secrets (YAML, one document each) for a cluster install: `<prefix><user>` with key `url` for every
    service user and `kube` (what the Helm chart's natsAuth reads), and `<prefix>server-auth` with the server's
    `nats-auth.conf` (for the NATS chart, or a NATS in the cluster, to include). Team and admin credentials are
    not in it: those are people's and pipelines', handed out from credentials.json."""
    def secret(name: str, data: dict[str, str]) -> dict[str, object]:
        meta: dict[str, object] = {"name": name, "labels": {"app.kubernetes.io/part-of": "gpuq",
                                                             "gpuq.io/nats-auth": bundle.namespace}}
        if namespace:
            meta["namespace"] = namespace
        return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": meta, "stringData": data}

    docs = [secret(f"{prefix}{user}", {"url": bundle.url(base_url, user)})
            for user in (*SERVICES, KUBE) if user in bundle.passwords]
    docs.append(secret(f"{prefix}{SERVER_SECRET_SUFFIX}", {SERVER_CONFIG_FILE: bundle.server_config}))
    return yaml.safe_dump_all(docs, sort_keys=False)


def read_credentials(path: Path) -> dict[str, str]:
    """user -> password from a `credentials.json` written by `write_bundle`."""
    try:
        doc = json.loads(path.read_text())
        return {u: str(v["password"]) for u, v in dict(doc["users"]).items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise NatsAuthError(f"cannot read bus credentials from {path}: {exc}") from exc
