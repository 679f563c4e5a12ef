#!/usr/bin/env bash
# The device check in one command: install from the repo's own files, then benchmarks/device_check.py
# (parity tests on the accelerator, training and sampling at GPU sizes), all inside --time-limit-s.
#
#   bash benchmarks/device_check.sh                    # on the GPU machine; results under $OUT or benchmarks/results/
#   bash benchmarks/device_check.sh --dry-run          # the same stages on CPU at tiny sizes, no install (CI)
#   bash benchmarks/device_check.sh --time-limit-s 300 --no-install
#
# Install: wheels carried in .whl/ (if any) go to /tmp/smolgym-site with no index. Then, when the packages
# the stages import are already there (the H200 image has JAX with CUDA, torch, transformers, peft, pytest),
# the repo alone is installed (`pip install -e . --no-deps --no-index`), keeping the machine's CUDA JAX and
# torch; otherwise `pip install -e '.[gpu,dev]'` from the registry, given 120 s. Carry wheels for a machine
# without a registry that lacks a package: see benchmarks/RESULTS.md. Whatever the install does, the
# stages put the repo's own `tx` first on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."

LIMIT=450 DRY=0 INSTALL=1 PY=${PYTHON:-python3}
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 INSTALL=0 ;;
        --no-install) INSTALL=0 ;;
        --time-limit-s) LIMIT=$2; shift ;;
        *) echo "usage: $0 [--dry-run] [--no-install] [--time-limit-s N]" >&2; exit 2 ;;
    esac
    shift
done
START=$(date +%s)
OUT_DIR=${OUT:-benchmarks/results}
mkdir -p "$OUT_DIR"
log() { echo "[device_check.sh $(( $(date +%s) - START )) s] $*"; }
NEEDED="jax flax optax orbax.checkpoint numpy ml_dtypes safetensors transformers tokenizers huggingface_hub torch peft pytest psutil tqdm"

missing() {
    "$PY" - $NEEDED <<'EOF'
import importlib.util, sys
print(" ".join(name for name in sys.argv[1:] if importlib.util.find_spec(name) is None))
EOF
}

install() {
    if ls .whl/*.whl >/dev/null 2>&1; then
        log "installing the wheels carried in .whl/ into /tmp/smolgym-site"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/smolgym-site .whl/*.whl \
            && export PYTHONPATH=/tmp/smolgym-site${PYTHONPATH:+:$PYTHONPATH}
    fi
    local lacking
    lacking=$(missing)
    if [ -z "$lacking" ]; then
        log "the stages' packages are all installed: installing the repo alone, keeping the machine's JAX and torch"
        "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || log "editable install failed: PYTHONPATH carries the repo"
    elif timeout 120 "$PY" -m pip install -q --timeout 10 --retries 0 -e '.[gpu,dev]'; then
        log "installed -e '.[gpu,dev]' from the registry"
    else
        log "no registry and missing: $lacking (carry them as wheels in .whl/); the stages that need them will fail"
    fi
}

if [ "$INSTALL" = 1 ]; then
    install
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
LEFT=$(( LIMIT - ($(date +%s) - START) ))
log "running the stages in the $LEFT s left"
ARGS=(--time-limit-s "$LEFT" --out-dir "$OUT_DIR")
[ "$DRY" = 1 ] && ARGS+=(--dry-run)
"$PY" benchmarks/device_check.py "${ARGS[@]}" 2>&1 | tee "$OUT_DIR/device_check.log"
