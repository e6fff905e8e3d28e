"""Platform namespaces: several gpuq platforms (production, a demo, each test session) on one NATS server.

A namespace is carried in every subject (`<namespace>.job.submitted`) and every stream name
(`<NAMESPACE>_JOBS`), so a platform only ever sees, creates or deletes its own streams. The default namespace
`gpuq` gives the historical names (`gpuq.job.>` in stream `GPUQ_JOBS`), so existing deployments keep theirs.

One process serves one platform: the namespace comes from `GPUQ_NAMESPACE` (validated on first use). The
CloudEvents `type` (`io.gpuq.job.submitted.v1`) does not change with the namespace: it names the contract, not
the platform.

Postgres is not namespaced by schema: a platform owns its database (`DATABASE_URL`). The demo and the test
sessions create databases of their own instead of reusing one (see `cli/platform.py`, `tests/conftest.py`).
"""

from __future__ import annotations

import os
import re
import secrets
from functools import lru_cache

ENV = "GPUQ_NAMESPACE"
DEFAULT = "gpuq"
# A subject token and, upper-cased with '-' -> '_', a stream-name prefix: the mapping is one-to-one because '_'
# is not allowed in a namespace.
NAMESPACE_RE = re.compile(r"^[a-z][a-z0-9-]{0,31}$")


class NamespaceError(ValueError):
    pass


@lru_cache(maxsize=64)
def validate(namespace: str) -> str:
    if not NAMESPACE_RE.match(namespace):
        raise NamespaceError(
            f"invalid gpuq namespace {namespace!r} ({ENV}): 1-32 characters, a lower-case letter first, then "
            "lower-case letters, digits or '-'")
    return namespace


def current() -> str:
    """The namespace of this process's platform: `GPUQ_NAMESPACE`, else `gpuq`."""
    return validate(os.environ.get(ENV) or DEFAULT)


def stream_prefix(namespace: str) -> str:
    return validate(namespace).upper().replace("-", "_")


def fresh(prefix: str) -> str:
    """A new namespace nobody else uses, e.g. `demo-3f9a1c` (demo runs, test sessions)."""
    return validate(f"{prefix}-{secrets.token_hex(4)}")


def subject(tail: str) -> str:
    """`tail` (e.g. "job.submitted") in this process's namespace: "gpuq.job.submitted" by default."""
    return f"{current()}.{tail}"
