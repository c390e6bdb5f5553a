#!/usr/bin/env bash
# Install AdaCheck with its test extras into .venv and run the whole test suite.
source "$(dirname "$0")/_env.sh" test
exec "$VPY" -m pytest -q "$@"
