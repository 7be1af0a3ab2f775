#!/usr/bin/env bash
# The project's test command (README; .ci/run calls exactly this).
# On a fresh machine: creates .venv if missing, installs the CPU requirements and the project,
# then runs the whole pytest suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source run_scripts/_venv.sh
exec python -m pytest "$@"
