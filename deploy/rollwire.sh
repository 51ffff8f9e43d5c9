#!/usr/bin/env bash
# Install rollwire into .venv when needed, then run `rollwire ARGS` (or the tests with `test ARGS`).
# Works on a fresh machine with Python 3.11, Java 17 and Maven (see README).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${ROLLWIRE_VENV:-$root/.venv}
stamp=$venv/.rollwire-installed

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet -e "$root[test]"
  # rollwire[trl]'s TRL without its torch (gigabytes): the TRL bridge's tests borrow the vLLM environment's
  # torch (sinks/trainer/torch_env.py); the pins are pyproject.toml's trl extra.
  "$venv/bin/python" -m pip install --quiet "psutil>=5.9.4"
  "$venv/bin/python" -m pip install --quiet --no-deps "trl==1.16.0" "accelerate==1.15.0"
  touch "$stamp"
fi

if [ "${1:-}" = "test" ]; then
  shift
  cd "$root"
  exec "$venv/bin/python" -m pytest "$@"
fi
exec "$venv/bin/rollwire" "$@"
