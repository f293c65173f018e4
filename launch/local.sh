#!/usr/bin/env bash
# Run `edgefl simulate` on this machine. Every argument is passed through unchanged, e.g.
#
#   launch/local.sh                                   # the built-in job, 20 rounds
#   launch/local.sh --rounds 3 --out /tmp/x           # 3 rounds into /tmp/x
#   launch/local.sh exp.toml --devices 32 --ranks 5   # your config, 32 devices on 4 workers
#
# `edgefl simulate` starts mpiexec itself (the one in the virtualenv unless EDGEFL_MPIEXEC
# names another) with 1 coordinator + N worker ranks; see docs/quickstart.md.
#
# Which edgefl runs: $EDGEFL if set, else `edgefl` on PATH, else .venv/bin/edgefl of this
# checkout.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"

if [[ -n "${EDGEFL:-}" ]]; then
  edgefl="$EDGEFL"
elif command -v edgefl >/dev/null 2>&1; then
  edgefl="$(command -v edgefl)"
elif [[ -x "$repo/.venv/bin/edgefl" ]]; then
  edgefl="$repo/.venv/bin/edgefl"
else
  echo "local.sh: edgefl not found: activate the virtualenv, or set EDGEFL=/path/to/edgefl" >&2
  exit 2
fi

exec "$edgefl" simulate "$@"
