#!/usr/bin/env python
"""The long fuzz run of the HTTP server (thousands of hypothesis / schemathesis requests beside
well-formed ones): `python scripts/fuzz_server.py --requests 5000 [--url URL --api-key KEY]`.
The code is tests/entrypoints/fuzz.py and fuzz_runner.py; the short run is in the test suite."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.entrypoints.fuzz_runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
