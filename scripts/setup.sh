#!/usr/bin/env bash
# Creates .venv with Python >= 3.12 and installs jaxrunner into it.
#   scripts/setup.sh          the engine (what the main job needs)
#   scripts/setup.sh --test   plus the test extra (pytest, hypothesis, torch for HF parity)
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local candidates=()
  if command -v pyenv >/dev/null 2>&1; then
    candidates+=($(ls -d "$(pyenv root)"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -V -r))
  fi
  candidates+=(python3.13 python3.12 python3)
  for py in "${candidates[@]}"; do
    if "$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$py"; return 0
    fi
  done
  echo "no Python >= 3.12 found (jax >= 0.11 needs it)" >&2
  return 1
}

if [ ! -x .venv/bin/python ]; then
  "$(find_python)" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ "${1:-}" = "--test" ]; then
  .venv/bin/python -m pip install -q -e '.[test]'
else
  .venv/bin/python -m pip install -q -e .
fi
