#!/usr/bin/env bash
# Start an edgefl job with mpirun over the hosts of a hostfile (Open MPI or MPICH/Hydra).
#
#   launch/mpirun.sh [-n RANKS] [-f HOSTFILE] CONFIG.toml [edgefl run options...]
#
#   -n RANKS     MPI ranks in total = 1 coordinator + RANKS-1 workers
#                (default: the sum of the slots in the hostfile)
#   -f HOSTFILE  hostfile (default: launch/hostfile); see launch/hostfile.example
#   the rest     passed to `edgefl run`, e.g. --out runs/exp1, --resume CKPT.h5, --set k=v
#
# Examples:
#   launch/mpirun.sh -n 65 -f hosts exp.toml --out runs/exp   # 64 workers
#   launch/mpirun.sh -f hosts exp.toml --out runs/exp --resume runs/exp/checkpoints/ckpt-000040.h5
#
# Environment:
#   MPIRUN   the launcher (default: mpirun on PATH). It must belong to the MPI that mpi4py
#            was built against.
#   EDGEFL   the edgefl executable (default: edgefl on PATH); must exist at the same path on
#            every node (a shared filesystem, or the same virtualenv path everywhere).
#   MPIRUN_EXTRA  extra launcher flags, word-split (e.g. "--oversubscribe").
#
# Every rank reads CONFIG and the data files named in it, so they must be readable at the
# same path on every node. Only rank 0 writes the run directory. See docs/cluster.md.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ranks=""
hostfile="$here/hostfile"
while getopts "n:f:h" opt; do
  case "$opt" in
    n) ranks="$OPTARG" ;;
    f) hostfile="$OPTARG" ;;
    h) sed -n '2,23p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "usage: $0 [-n RANKS] [-f HOSTFILE] CONFIG.toml [edgefl run options...]" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [[ $# -lt 1 ]]; then
  echo "usage: $0 [-n RANKS] [-f HOSTFILE] CONFIG.toml [edgefl run options...]" >&2
  exit 2
fi
if [[ ! -f "$hostfile" ]]; then
  echo "mpirun.sh: hostfile '$hostfile' not found (copy launch/hostfile.example)" >&2
  exit 2
fi

mpirun="${MPIRUN:-$(command -v mpirun || true)}"
edgefl="${EDGEFL:-$(command -v edgefl || true)}"
if [[ -z "$mpirun" ]]; then echo "mpirun.sh: no mpirun on PATH (set MPIRUN)" >&2; exit 2; fi
if [[ -z "$edgefl" ]]; then echo "mpirun.sh: no edgefl on PATH (set EDGEFL)" >&2; exit 2; fi

# Default rank count: the slots of the hostfile ("host slots=N" or "host:N"; a bare host = 1).
if [[ -z "$ranks" ]]; then
  ranks="$(awk '
    { sub(/#.*/, "") } NF == 0 { next }
    { n = 1
      if (match($0, /slots=[0-9]+/)) n = substr($0, RSTART + 6, RLENGTH - 6)
      else if (match($1, /:[0-9]+$/)) n = substr($1, RSTART + 1)
      total += n }
    END { print total + 0 }' "$hostfile")"
fi
if ! [[ "$ranks" =~ ^[0-9]+$ ]] || (( ranks < 2 )); then
  echo "mpirun.sh: need at least 2 ranks (1 coordinator + workers), got '$ranks'" >&2
  exit 2
fi

# Progress: a one-line bar only when our stdout is a terminal; plain lines in log files.
# (Open MPI gives ranks a pseudo-terminal, so rank 0 cannot tell by itself.)
if [[ -t 1 ]]; then export EDGEFL_TTY=1; else export EDGEFL_TTY=0; fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"   # torch threads come from fleet.threads
export PYTHONUNBUFFERED=1

flags=()
case "$("$mpirun" --version 2>&1)" in
  *"Open MPI"* | *OpenRTE*)
    # Open MPI forwards only the variables named with -x to remote nodes.
    # --map-by slot: fill each host's slots in hostfile order (rank 0 on the first host);
    # --bind-to none: let each rank's torch threads (fleet.threads) use any core.
    flags+=(--hostfile "$hostfile" --map-by slot --bind-to none)
    for v in PATH LD_LIBRARY_PATH PYTHONPATH OMP_NUM_THREADS PYTHONUNBUFFERED \
             EDGEFL_TTY EDGEFL_LOG; do
      if [[ -n "${!v+x}" ]]; then flags+=(-x "$v"); fi
    done
    if [[ "$(id -u)" -eq 0 ]]; then flags+=(--allow-run-as-root); fi
    ;;
  *HYDRA* | *MPICH* | *"Intel(R) MPI"*)
    # Hydra forwards the whole environment by default.
    flags+=(-f "$hostfile")
    ;;
  *)
    echo "mpirun.sh: unknown MPI ($mpirun --version); trying --hostfile" >&2
    flags+=(--hostfile "$hostfile")
    ;;
esac
# shellcheck disable=SC2206  # MPIRUN_EXTRA is meant to be word-split
if [[ -n "${MPIRUN_EXTRA:-}" ]]; then flags+=(${MPIRUN_EXTRA}); fi

set -x
exec "$mpirun" "${flags[@]}" -n "$ranks" "$edgefl" run "$@"
