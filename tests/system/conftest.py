"""Make the area's helpers importable (the suite runs with --import-mode=importlib, which adds no paths)."""

from __future__ import annotations

import sys
from pathlib import Path

for _path in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1] / "support"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
