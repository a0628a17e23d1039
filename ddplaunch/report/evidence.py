"""The files a person opens by hand in a run's directory, rendered from the run's events as they
are appended: the health check's verdict (`healthcheck.json`) and the localization's chart
(`localize.html`). Nothing reads them back; the events hold the same facts (`--json` shows them).
"""

from __future__ import annotations

import json
from pathlib import Path

from ddplaunch.diagnose.localize import render_html
from ddplaunch.record.events import Event, Localized, StageEnded
from ddplaunch.record.runs import write_private

HEALTHCHECK_FILE = "healthcheck.json"
LOCALIZE_PAGE = "localize.html"


class EvidenceFiles:
    """An event log's listener that writes the evidence files of the run in `run_dir`."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir

    def __call__(self, event: Event) -> None:
        if isinstance(event, StageEnded) and event.result.ran_healthcheck and event.result.healthcheck is not None:
            write_private(self.run_dir / HEALTHCHECK_FILE,
                          json.dumps(event.result.healthcheck.to_dict(), indent=2, sort_keys=True))
        elif isinstance(event, Localized):
            write_private(self.run_dir / LOCALIZE_PAGE, render_html(event.localization))
