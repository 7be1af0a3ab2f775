#!/usr/bin/env bash
# The project's test command (README; .ci/run calls exactly this).
# On a fresh machine: creates .venv if missing, installs the CPU requirements and the project,
# then runs the whole pytest suite on TEST_WORKERS [2] pytest-xdist workers, each test module (or
# group of modules sharing trainer runs, tests/conftest.py) on one worker. Extra arguments go to
# pytest (`-n 0`: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
source run_scripts/_venv.sh
exec python -m pytest -n "${TEST_WORKERS:-2}" "$@"
