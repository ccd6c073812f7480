"""The client's tests run the real binaries with the repository's test harness
(tests/python/harness.py): ORCHESTRATOR_BIN_DIR names their directory (default target/debug)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "python"))

from harness import served_factory  # noqa: E402,F401
