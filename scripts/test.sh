#!/usr/bin/env bash
# The whole test suite, from nothing: set up .venv, then pytest under an outside timeout.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
# Two workers (the CI machine's two cores), each test file on one worker: its module fixtures and
# its pod slices stay together; every test still runs under its own pytest-timeout. Files start in
# collection order, the longest first (tests/conftest.py): --no-loadscope-reorder keeps xdist from
# reordering them by their number of tests, which put the serving stack (17 tests, half an hour)
# behind every file with more tests.
exec timeout -k 30 4800 .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile \
    --no-loadscope-reorder --durations=30 "$@"
