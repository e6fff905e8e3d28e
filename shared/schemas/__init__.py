"""Committed JSON Schemas of every event payload and of the envelope.

`python -m shared.schemas --write` regenerates the files after a deliberate (additive, v1-compatible)
change; `tests/unit/test_event_schemas.py` fails when a model changes without its file being updated.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from shared.events import CATALOGUE, SCHEMA_URI_BASE, CloudEvent, schema_uri

SCHEMA_DIR = Path(__file__).parent
ENVELOPE = "io.gpuq.envelope"
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def current_schemas() -> dict[str, dict[str, Any]]:
    """Every committed schema by name: each event type's payload schema, and the envelope's. Each names its
    dialect and its `$id`, the URI an event's `dataschema` carries (`shared.events.schema_uri`)."""
    out = {cls.event_type(): cls.model_json_schema() for cls in CATALOGUE}
    out[ENVELOPE] = CloudEvent.model_json_schema()
    return {name: {"$schema": JSON_SCHEMA_DIALECT, "$id": schema_uri(name), **schema}
            for name, schema in out.items()}


def schema_for_uri(uri: str) -> dict[str, Any]:
    """The committed schema a `dataschema` URI names (resolved from the files here, never fetched)."""
    name = uri.removeprefix(SCHEMA_URI_BASE).removesuffix(".json")
    path = schema_path(name)
    if not uri.startswith(SCHEMA_URI_BASE) or not uri.endswith(".json") or "/" in name or not path.exists():
        raise KeyError(f"no committed gpuq schema has the URI {uri!r}")
    schema: dict[str, Any] = json.loads(path.read_text())
    return schema


def schema_path(event_type: str) -> Path:
    return SCHEMA_DIR / f"{event_type}.json"


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def write_all() -> list[Path]:
    written = []
    for event_type, schema in current_schemas().items():
        path = schema_path(event_type)
        path.write_text(render(schema))
        written.append(path)
    return written


if __name__ == "__main__":  # pragma: no cover - `python -m shared.schemas` uses __main__.py
    if "--write" in sys.argv:
        for p in write_all():
            print(p)
    else:
        print("usage: python -m shared.schemas --write")
