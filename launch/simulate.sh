#!/usr/bin/env bash
# Simulate a heterogeneous edge fleet on this workstation with `edgefl simulate` (virtual
# clock: results do not depend on how loaded the machine is). Picks the number of MPI ranks
# from the core count; every argument is passed through unchanged, e.g.
#
#   launch/simulate.sh                                         # built-in job, uniform fleet
#   launch/simulate.sh exp.toml --devices 1000                 # 1,000 devices, ranks = cores + 1
#   launch/simulate.sh exp.toml --set sim.profiles=edge-mix --devices 16 --out runs/mix
#   launch/simulate.sh exp.toml --set sim.profiles=datasets/profiles/example-trace.csv
#   launch/simulate.sh exp.toml --ranks 9                      # your rank count wins
#   launch/simulate.sh exp.toml --dry-run                      # print the mpiexec command
#
# Ranks: 1 coordinator + one worker per core (cores = `nproc`, which honours CPU affinity
# and cgroup limits), unless you give --ranks, --set fleet.ranks=..., or EDGEFL_RANKS. The
# coordinator mostly sleeps between events, so it does not need a core of its own. Each
# worker hosts many devices (device d on worker 1 + d mod W) and trains them one after
# another, so more devices cost time, not ranks; keep fleet.threads = 1 (the default) so
# W workers x 1 torch thread fill the W cores. `edgefl simulate` never starts more workers
# than devices.
#
# Device profiles (speed, memory cap, links, availability, failures): sim.profiles, see
# docs/device-profiles.md. Time and rank mapping for large fleets: docs/cluster.md and
# launch/slurm-simulate.sbatch.
#
# Environment:
#   EDGEFL        the edgefl executable (default: edgefl on PATH, else .venv/bin/edgefl of
#                 this checkout)
#   EDGEFL_RANKS  total ranks, coordinator included (default: cores + 1)
#   EDGEFL_MPIEXEC  the mpiexec `edgefl simulate` uses (default: the one in the virtualenv)
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
  echo "simulate.sh: edgefl not found: activate the virtualenv, or set EDGEFL=/path/to/edgefl" >&2
  exit 2
fi

# Did the caller choose the rank count already?
given=0
prev=""
for a in "$@"; do
  case "$a" in
    --ranks | --ranks=*) given=1 ;;
    fleet.ranks=* ) [[ "$prev" == "--set" ]] && given=1 ;;
    --set=fleet.ranks=*) given=1 ;;
  esac
  prev="$a"
done

extra=()
if (( given == 0 )); then
  if [[ -n "${EDGEFL_RANKS:-}" ]]; then
    ranks="$EDGEFL_RANKS"
  else
    cores="$(nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 1)"
    ranks=$(( cores + 1 ))
  fi
  if ! [[ "$ranks" =~ ^[0-9]+$ ]] || (( ranks < 2 )); then
    echo "simulate.sh: need at least 2 ranks (1 coordinator + workers), got '$ranks'" >&2
    exit 2
  fi
  extra=(--ranks "$ranks")
fi

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"   # one BLAS/torch thread per rank
exec "$edgefl" simulate "$@" ${extra[@]+"${extra[@]}"}
