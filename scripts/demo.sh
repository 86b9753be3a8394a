#!/usr/bin/env bash
# Offline demo on a fresh machine: sets up .venv (torch 2.13.0 CPU, newest tested transformers) and runs
# examples/demo.py, which builds a tiny random checkpoint from config.json and generates. Extra arguments go to it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec "$PY" "$ROOT/examples/demo.py" "$@"
