"""Committed JSON Schemas of every event payload and of the envelope.

`python -m shared.schemas --write` regenerates the files after a deliberate (additive, v1-compatible)
change; `tests/unit/test_event_schemas.py` fails when a model changes without its file being updated.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from shared.events import CATALOGUE, CloudEvent

SCHEMA_DIR = Path(__file__).parent


def current_schemas() -> dict[str, dict[str, Any]]:
    out = {cls.event_type(): cls.model_json_schema() for cls in CATALOGUE}
    out["io.gpuq.envelope"] = CloudEvent.model_json_schema()
    return out


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
