"""Print the collections measured by scripts/gc_pauses/sitecustomize.py: one line per process and generation."""

import json
import sys
from pathlib import Path


def main(folder: str) -> None:
    rows = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))]
    print(f"{'process':<12} {'collection':<14} {'count':>6} {'cpu_s':>7} {'max_cpu_ms':>10} {'max_wall_ms':>11}")
    for row in sorted(rows, key=lambda r: (r["process"], r["pid"])):
        for key, s in row["collections"].items():
            print(f"{row['process']:<12} {key:<14} {s['count']:>6} {s['cpu_s']:>7.3f} {s['max_cpu_ms']:>10.1f} "
                  f"{s['max_wall_ms']:>11.1f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
