#!/usr/bin/env bash
# The GPU check: install the CUDA builds named in the README ("GPU install") into a fresh virtual
# environment, run the default matrix (every backend configuration, dp 1 and 2, torch's envelope) on the
# GPU, compare, and print the verdicts with the devices and determinism settings each run recorded.
# With two or more GPUs visible it also runs the torch multi-GPU DDP path (NCCL) at dp=2 against dp=1.
#
#   bash bench/gpu_check.sh [OUT_DIR]              (default OUT_DIR: ./gpu-check)
#
# Environment:
#   DUIPAI_WHEELS=DIR   install from wheels in DIR only (pip --no-index --find-links DIR), for a machine
#                       without access to PyPI; without it pip downloads the CUDA builds (several GB)
#   DUIPAI_GPU_VENV=DIR the virtual environment to create or reuse (default: OUT_DIR/venv)
#   DUIPAI_GPU_STEPS=N  steps per run (default 300, the default matrix's; 100 fits slow machines)
#
# Sized for one GPU: about 3-5 minutes after the install (15 runs of 300 steps of a small CNN, one at a
# time, plus the comparison). Each stage is bounded by `timeout`, so the script ends in at most 8 minutes
# after the install whatever hangs. Exit status: 0 when every pair with the reference is DRIFT, IDENTICAL
# or DECLARED; 1 when a verdict is BUG or INCONCLUSIVE; 3 when a stage failed (see the log lines).
#
# Status: written for issue 14, NOT yet run on a GPU (no GPU machine was lent to a session so far).
# When it runs, put its output in the README's "GPU path" section with the date and the machine.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(mkdir -p "${1:-gpu-check}" && cd "${1:-gpu-check}" && pwd)"
VENV="${DUIPAI_GPU_VENV:-$OUT/venv}"
STEPS="${DUIPAI_GPU_STEPS:-300}"
STATUS=0
say() { printf '\n== %s\n' "$*"; }

say "machine"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || {
    echo "nvidia-smi failed: no NVIDIA GPU visible; this check needs one" >&2; exit 3; }
NGPU=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
echo "GPUs visible: $NGPU; python: $(python3 --version 2>&1)"

say "install (CUDA builds, as in the README's GPU install)"
PIP_SRC=()
[ -n "${DUIPAI_WHEELS:-}" ] && PIP_SRC=(--no-index --find-links "$DUIPAI_WHEELS")
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" || exit 3
PY="$VENV/bin/python"
t0=$(date +%s)
if [ -n "${DUIPAI_WHEELS:-}" ]; then
    "$PY" -m pip install -q "${PIP_SRC[@]}" torch==2.13.0 || exit 3
else
    "$PY" -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128 || exit 3
fi
"$PY" -m pip install -q "${PIP_SRC[@]}" 'jax[cuda12]==0.10.2' optax 'tensorflow[and-cuda]==2.21.*' 'keras==3.15.*' || exit 3
"$PY" -m pip install -q "${PIP_SRC[@]}" --no-deps "$ROOT" || exit 3
"$PY" -m pip install -q "${PIP_SRC[@]}" numpy pandas matplotlib scikit-learn click tabulate rich || exit 3
echo "installed in $(( $(date +%s) - t0 )) s"
DUIPAI="$VENV/bin/duipai"

say "what each framework sees"
timeout 120 "$PY" - <<'EOF' || STATUS=3
import importlib
for mod, probe in [("torch", "torch.cuda.device_count()"), ("jax", "jax.devices()"),
                   ("tensorflow", "tensorflow.config.list_physical_devices('GPU')")]:
    try:
        m = importlib.import_module(mod)
        print(f"{mod} {m.__version__}: {eval(probe, {mod: m})}")
    except Exception as e:  # a missing CUDA build is the finding, not a crash of the check
        print(f"{mod}: {type(e).__name__}: {e}")
EOF

say "default matrix on the GPU (dp 1 and 2, every backend configuration)"
MATRIX="$OUT/gpu-default.toml"
sed "s/^steps = .*/steps = $STEPS/; s/^name = .*/name = \"gpu-default\"/" "$ROOT/harness/matrices/default.toml" > "$MATRIX"
( cd "$OUT" && timeout 390 "$DUIPAI" all --matrix "$MATRIX" --out "$OUT/results" -j 1 ) 2>&1 | tee "$OUT/all.log"
rc=${PIPESTATUS[0]}
echo "duipai all exit: $rc"
[ "$rc" -eq 0 ] || { [ "$rc" -eq 1 ] && STATUS=1 || STATUS=3; }

if [ "$NGPU" -ge 2 ]; then
    say "torch DistributedDataParallel over 2 GPUs (NCCL) against dp=1"
    DDP="$OUT/results/torch-ddp"
    for d in 1 2; do
        timeout 90 "$DUIPAI" run -b torch --devices "$d" --steps "$STEPS" --out "$DDP" || STATUS=3
    done
    timeout 60 "$DUIPAI" compare "$DDP" || STATUS=1
fi

say "devices and determinism recorded by every run"
"$PY" - "$OUT/results" <<'EOF'
import json, sys
from pathlib import Path
for m in sorted(Path(sys.argv[1]).rglob("manifest.json")):
    j = json.loads(m.read_text())
    if j.get("kind") != "train":
        continue
    print(f"{j['run']}: devices={j.get('devices')} determinism={j.get('determinism')} parallel={j.get('parallel')}")
EOF
say "done: exit $STATUS (0 all DRIFT/IDENTICAL/DECLARED, 1 a BUG or INCONCLUSIVE, 3 a stage failed); output in $OUT"
exit $STATUS
