"""Reviewed expected outputs: `check_golden` compares rendered text with tests/golden/NAME.
Refresh them all with `UPDATE_GOLDEN=1 pytest tests` and review the diff before committing."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).with_name("golden")


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    text = text.replace(str(ROOT), "<ROOT>")
    if os.environ.get("UPDATE_GOLDEN"):
        assert os.environ.get("CI", "").lower() not in ("1", "true", "yes"), \
            "UPDATE_GOLDEN must never be set in CI: it would pass any rendering"
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; review and refresh with UPDATE_GOLDEN=1"
