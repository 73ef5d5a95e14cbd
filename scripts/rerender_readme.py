"""Re-render a built-in checkpoint's README.md from its training.json (after a folder is copied
into checkpoints/, or its reproduce commands change), then rewrite SHA256SUMS.

    python scripts/rerender_readme.py checkpoints/stories-diffusion
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from leapfrog.train.check import CheckResult
from leapfrog.train.export import write_sha256sums
from leapfrog.train.readme import render


def main(folder: str) -> None:
    path = Path(folder)
    summary = json.loads((path / "training.json").read_text())
    check = CheckResult(summary["config"]["name"], summary.get("check", {}), summary.get("check_samples", []))
    (path / "README.md").write_text(render(summary, check, path))
    write_sha256sums(path)


if __name__ == "__main__":
    main(sys.argv[1])
