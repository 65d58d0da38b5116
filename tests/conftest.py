"""Shared fixtures: `tests/support.py` holds the helpers; this file only makes them importable."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
