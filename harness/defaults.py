"""Defaults taken from the default matrix (harness/matrices/default.toml), so that no harness module
names a backend: the reference backend is whatever that file says."""
from __future__ import annotations

import tomllib
from pathlib import Path

MATRICES_DIR = Path(__file__).parent / "matrices"
REFERENCE: str = tomllib.loads((MATRICES_DIR / "default.toml").read_text())["reference"]
