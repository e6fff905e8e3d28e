"""Make the fixture exporter and the Prometheus helper importable (--import-mode=importlib adds no paths)."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[2]
for _path in (_TESTS / "support",):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
