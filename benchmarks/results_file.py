"""Where a benchmark's results go: NAME-DATE[-K].json (the data) and .txt (the table) in one directory."""

from __future__ import annotations

import json
import os


def write_results(out_dir: str, name: str, stamp: str, payload: dict, text: str) -> str:
    """Write payload as JSON and text beside it under a name not taken yet; returns the path without suffix."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"{name}-{stamp}")
    n = 1
    while os.path.exists(base + (f"-{n}" if n > 1 else "") + ".json"):
        n += 1
    path = base + (f"-{n}" if n > 1 else "")
    with open(path + ".json", "w") as f:
        json.dump(payload, f, indent=1)
    with open(path + ".txt", "w") as f:
        f.write(text)
    print("\n" + text + f"\nwritten: {path}.json, {path}.txt")
    return path
