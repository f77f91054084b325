#!/usr/bin/env bash
# rlhf's GPU check, in one call of the lent device machine (benchmarks/README.md, "GPU").
#
#   bash tools/gpu_check.sh                            here: build the wheel bundle (.gpu-bundle/), print its size
#   bash tools/gpu_check.sh --dry-run [--no-download]  here, on a CPU: the bundle (with --no-download, offline:
#                                                      this checkout's wheel and the list of the rest), the device
#                                                      plan, then every check at toy sizes (what CI tests)
#   bash tools/gpu_check.sh --device                   on the device: install the bundle without network, run the
#                                                      checks, write $OUT/gpu_check.{json,md,log}
#
# The device call: command "bash tools/gpu_check.sh --device", carry [".gpu-bundle"], timeout_s 420.
# Options: --bundle-dir DIR (default .gpu-bundle), --leave-out a,b (packages not to bundle, e.g. bitsandbytes,
# 41 MiB), --out DIR (default $OUT), --only a,b (checks by name), --budget-s N (default 270: the checks'
# wall-clock budget), --jobs N. PYTHON picks the interpreter (python3); GPU_CHECK_WORK and GPU_CHECK_SITE the
# device half's scratch and install folders (/tmp/rlhf-gpu-check, /tmp/rlhf-gpu-site).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
MODE=bundle
BUNDLE=.gpu-bundle
NO_DOWNLOAD=
LEAVE_OUT=()
OUT_DIR=${OUT:-}
PASS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) MODE=dry-run ;;
        --device) MODE=device ;;
        --no-download) NO_DOWNLOAD=--no-download ;;
        --bundle-dir) BUNDLE=$2; shift ;;
        --leave-out) LEAVE_OUT=(--leave-out "$2"); shift ;;
        --out) OUT_DIR=$2; shift ;;
        --only|--budget-s|--jobs) PASS+=("$1" "$2"); shift ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown option $1 (see bash tools/gpu_check.sh --help)" >&2; exit 2 ;;
    esac
    shift
done

bundle() {
    "$PY" -m tools.gpu_kit bundle --dir "$BUNDLE" $NO_DOWNLOAD "${LEAVE_OUT[@]}"
}

dry_run() {
    bundle || exit $?
    echo
    "$PY" -m tools.gpu_kit plan --commands "${PASS[@]}" || exit $?
    echo
    local out=${OUT_DIR:-$(mktemp -d -t rlhf-gpu-check-dry.XXXXXX)}
    echo "dry run: the checks at toy sizes on this CPU; results in $out"
    "$PY" -m tools.gpu_kit run --cpu --out "$out" "${PASS[@]}"
}

device() {
    local out=${OUT_DIR:-$PWD/gpu-check-out} work=${GPU_CHECK_WORK:-/tmp/rlhf-gpu-check}
    local site=${GPU_CHECK_SITE:-/tmp/rlhf-gpu-site}
    if ! ls "$BUNDLE"/*.whl >/dev/null 2>&1; then
        echo "gpu_check.sh: no wheels in $BUNDLE: build them on the CPU machine (bash tools/gpu_check.sh) and carry" \
             "the folder ([\"$BUNDLE\"])" >&2
        exit 2
    fi
    mkdir -p "$out" "$work"
    local start=$SECONDS
    echo "installing $(ls "$BUNDLE"/*.whl | wc -l) wheels from $BUNDLE into $site (no network)"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            "$BUNDLE"/*.whl >"$work/install.log" 2>&1; then
        cat "$work/install.log"
        echo "gpu_check.sh: installing the bundle failed (above); rebuild it with bash tools/gpu_check.sh" >&2
        cp "$work/install.log" "$out/gpu_check.log"
        exit 2
    fi
    # this checkout first (the bundle's rlhf-core wheel gives it its metadata), then the bundle, then the image
    export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" -m tools.gpu_kit run --out "$out" --work "$work" --install-s $((SECONDS - start)) "${PASS[@]}"
}

case "$MODE" in
    bundle) bundle ;;
    dry-run) dry_run ;;
    device) device ;;
esac
