"""What the benchmarks write: a CSV of their rows, and plots when matplotlib is there."""

from __future__ import annotations

import csv
import os


def write_csv(rows: list[dict], out_dir: str, name: str) -> list[str]:
    """Write ``rows`` to ``out_dir/name`` (columns: every key, in order of first use); return the columns."""
    os.makedirs(out_dir, exist_ok=True)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with open(os.path.join(out_dir, name), "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    return keys


def pyplot():
    """matplotlib.pyplot drawing to files, or None (with a note) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    return plt
