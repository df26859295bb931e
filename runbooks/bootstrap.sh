#!/bin/sh
# Starts the job supervisor on an instance: finds a Python >= 3.8 and execs supervisor.py (which sits next to this
# script) with the arguments given, unchanged. The daemon runs e.g.
#   sh bootstrap.sh --daemonize --run-dir RUN --job-id J --attempt A --checkpoint-dir CKPT -- python3 train.py
# $BURST_PYTHON, if set, is tried first (images whose python3 is too old but have e.g. python3.10).
# `sh bootstrap.sh --which-python` prints the interpreter it would use instead (the daemon asks once per instance).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
for py in "${BURST_PYTHON:-}" python3 python; do
  [ -n "$py" ] || continue
  if command -v "$py" >/dev/null 2>&1 &&
     "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 8) else 1)' 2>/dev/null; then
    if [ "${1:-}" = "--which-python" ]; then
      command -v "$py"
      exit 0
    fi
    exec "$py" "$here/supervisor.py" "$@"
  fi
done
echo "bootstrap.sh: error: no Python >= 3.8 found (tried \$BURST_PYTHON, python3, python); set BURST_PYTHON" >&2
exit 127
