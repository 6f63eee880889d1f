#!/usr/bin/env bash
# Run the test suite with the project's venv. Extra arguments go to pytest.
# pytest's exit code 5 ("no tests collected", e.g. for a -k that matches
# nothing) is reported as an error too: a run that tested nothing is not green.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "run_tests: pytest collected no tests (exit 5)" >&2
fi
exit "$rc"
