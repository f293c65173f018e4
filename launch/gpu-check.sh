#!/usr/bin/env bash
# The GPU checks in one go, for a machine with a CUDA GPU (docs/cluster.md, "GPU check"):
#
#   launch/gpu-check.sh [OUT_DIR]        # default runs/gpu-check
#
# 1. what torch sees (torch and CUDA versions, the GPUs);
# 2. `edgefl bench staging`: a CUDA worker's push (device-to-host staging into pinned memory
#    + edgefl's UPDATE push) against raw mpi4py doing the same staging and an Isend;
# 3. one job mixing a CUDA worker and CPU workers (device 0 on cuda:0, the others on cpu),
#    the same job all on CPU, and the model hashes of both compared (equal only where the
#    arithmetic allows: float32 sums on a GPU are ordered differently, so the script also
#    prints the largest difference between the two final models);
# 4. the vectorized path (train.vectorize = "on") on CUDA: 1,000 devices of the CNN on digits
#    (full batches, stacks of one size), then 1,000 devices of the built-in MLP job
#    (mini-batches of devices of different sizes: padded stacks), each on one worker rank,
#    on cuda:0 and on cpu, in-process (--backend inline: the worker's training is the same
#    code as under MPI); the time of each, the tasks trained stacked, the final accuracies
#    and the largest absolute and relative difference between the two final models.
#
# GPU_CHECK_STEPS="1 4" runs only those steps (default "1 2 3 4"; step 1 always runs).
# GPU_CHECK_DEVICE=cpu runs every step with "cpu" in place of "cuda" (a dry run of the script
# on a machine without a GPU; it measures nothing about GPUs).
#
# Exit status: 0 all ran, 3 no CUDA device visible to torch (nothing was checked), else the
# status of the step that failed. Which edgefl runs: $EDGEFL, else `edgefl` on PATH, else
# .venv/bin/edgefl of this checkout; python is the one next to it.
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
  echo "gpu-check.sh: edgefl not found: activate the virtualenv, or set EDGEFL=/path/to/edgefl" >&2
  exit 2
fi
python="$(dirname "$edgefl")/python"
[[ -x "$python" ]] || python="$(command -v python3)"
out="${1:-runs/gpu-check}"
dev="${GPU_CHECK_DEVICE:-cuda}"
mkdir -p "$out"

echo "== 1. torch and the GPUs"
if ! "$python" - "$dev" <<'EOF'
import sys

import torch

print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
if sys.argv[1] == "cpu":
    sys.exit(0)
if not torch.cuda.is_available():
    sys.exit(3)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}: {p.name}, {p.total_memory / 2**30:.1f} GiB")
EOF
then
  echo "gpu-check.sh: torch sees no CUDA device here (torch.cuda.is_available() is False): nothing was checked" >&2
  exit 3
fi

steps=" ${GPU_CHECK_STEPS:-1 2 3 4} "

if [[ $steps == *" 2 "* ]]; then
echo "== 2. host staging: edgefl push from a CUDA worker vs raw mpi4py"
"$edgefl" bench staging --device "$dev" --json "$out/staging.json"
fi

if [[ $steps == *" 3 "* ]]; then
echo "== 3. a CUDA worker among CPU workers, and the same job on CPU only"
job=(--set fleet.devices=4 --set fleet.ranks=3 --set run.rounds=10 --set model.name=logreg
     --set output.progress=quiet --set run.checkpoint_every=0)
rm -rf "$out/mixed" "$out/cpu"
"$edgefl" simulate --out "$out/mixed" "${job[@]}" --set fleet.device=cpu \
  --set "fleet.device_map={\"0\" = \"$([[ $dev == cpu ]] && echo cpu || echo cuda:0)\"}"
"$edgefl" simulate --out "$out/cpu" "${job[@]}" --set fleet.device=cpu
"$python" - "$out" <<'EOF'
import json
import sys
from pathlib import Path

import torch

out = Path(sys.argv[1])
s = {k: json.loads((out / k / "summary.json").read_text()) for k in ("mixed", "cpu")}
for k, v in s.items():
    print(f"{k}: final accuracy {v['final_accuracy']:.4f}, model_sha256 {v['model_sha256']}")
models = {k: torch.load(out / k / "final_model.pt", map_location="cpu") for k in s}
diff = max(
    (models["mixed"][n].float() - models["cpu"][n].float()).abs().max().item()
    for n in models["cpu"]
)
same = s["mixed"]["model_sha256"] == s["cpu"]["model_sha256"]
print(f"model hash equal: {'yes' if same else 'no'}; largest parameter difference {diff:.3g}")
EOF
fi

if [[ $steps == *" 4 "* ]]; then
vec_check() {  # vec_check NAME JOB-ARGS...: the job stacked on $dev and on cpu, compared
local name="$1"; shift
local vjob=("$@" --backend inline --devices 1000 --rounds 3 --set fleet.ranks=2
            --set 'train.vectorize="on"' --set output.progress=quiet --set run.checkpoint_every=0)
rm -rf "$out/vec-$name-$dev" "$out/vec-$name-cpu"
"$edgefl" simulate --out "$out/vec-$name-$dev" "${vjob[@]}" --set "fleet.device=\"$dev\""
if [[ $dev != cpu ]]; then
  "$edgefl" simulate --out "$out/vec-$name-cpu" "${vjob[@]}" --set 'fleet.device="cpu"'
fi
"$python" - "$out" "$dev" "$name" <<'EOF'
import json
import sys
from pathlib import Path

import torch

out, dev, name = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
runs = {k: out / f"vec-{name}-{k}" for k in dict.fromkeys((dev, "cpu"))}
s = {k: json.loads((p / "summary.json").read_text()) for k, p in runs.items()}
for k, v in s.items():
    print(f"{name}, {k}: {v['wall_time_s']:.2f} s of rounds, {v['stacked_tasks']} tasks stacked, "
          f"final accuracy {v['final_accuracy']:.4f}, model_sha256 {v['model_sha256'][:16]}")
m = {k: torch.load(p / "final_model.pt", map_location="cpu") for k, p in runs.items()}
a, b = m[dev], m["cpu"]
absd = max((a[n].float() - b[n].float()).abs().max().item() for n in b)
reld = max(
    ((a[n].float() - b[n].float()).abs().max() / b[n].float().abs().max().clamp_min(1e-30)).item()
    for n in b
)
print(f"{name}, {dev} vs cpu: largest parameter difference {absd:.3g} "
      f"(relative to the tensor's largest |value|: {reld:.3g})")
if dev != "cpu":
    print(f"{name}, time of the rounds, cpu / {dev}: "
          f"{s['cpu']['wall_time_s'] / s[dev]['wall_time_s']:.2f}x")
EOF
}
echo "== 4. vectorized local training: 1,000 CNN devices on one worker, $dev vs cpu"
vec_check cnn recipe:digits-cnn-iid
echo "== 4. vectorized local training: 1,000 devices of the built-in MLP job (padded stacks), $dev vs cpu"
vec_check mlp
echo "== 4. vectorized local training: the CNN with BatchNorm, each device's own statistics (FedBN), $dev vs cpu"
vec_check cnn-fedbn recipe:digits-cnn-iid --set 'model.args={batchnorm=true}' --set 'model.buffers="local"'
echo "== 4. vectorized local training: the Hermes gate (each device from its own local model), $dev vs cpu"
vec_check hermes --set 'algorithm.gate="hermes"' --set 'algorithm.consistency="asp"' --set hermes.max_local_iterations=3
fi
echo "gpu-check.sh: done; results in $out"
