"""Writers for a run directory: ``metrics.jsonl`` (a line per step) and ``summary.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JsonLines:
    """Append-only JSON-lines file, flushed per record so a crash keeps what was written."""

    def __init__(self, path: Path):
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """Write ``data`` atomically (temp file + rename) and return ``path``."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path
