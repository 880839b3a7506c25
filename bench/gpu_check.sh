#!/usr/bin/env bash
# The first minutes on a GPU (bench/gpu_check.py says what each section checks): every section in its
# own process under its own time box, all merged into one JSON, $OUT/gpu-check.json (OUT defaults to
# bench/results), each section's output streamed into $OUT/gpu-check-logs/SECTION.txt as it runs (a
# section cut short keeps its partial log and what it had recorded, and is marked timed_out). Under 8
# minutes in all. Nothing is fetched from the network.
#
#   bash bench/gpu_check.sh             # on the GPU
#   bash bench/gpu_check.sh --dry-run   # every section on the CPU at tiny shapes (the same script)
#
# Kernels come from the Triton cache compiled on the CPU by bench/triton_cache.py into
# bench/results/local/triton-cache (carry that folder to the device); each section records its misses.
# Exit status: 0 when every section ran and passed; 1 when one failed or timed out, or none ran.
set -u
OUT=${OUT:-bench/results}
DRY=()
[ "${1:-}" = "--dry-run" ] && DRY=(--dry-run)
PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null; then
    echo "no section ran: $PY is not on this machine" >&2
    exit 1
fi
mkdir -p "$OUT/gpu-check-logs"
rm -f "$OUT/gpu-check.json"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/bench/results/local/triton-cache}
export PYTHONUNBUFFERED=1  # section output reaches its log as it is printed
# Triton's group files hold absolute paths: point them at where the carried cache lies now.
[ -d "$TRITON_CACHE_DIR" ] && "$PY" bench/triton_cache.py --relocate "$TRITON_CACHE_DIR"
# No registry there: no build isolation. Without pip, link the mapped packages into place
# (kernels/ and models/ install as lucebox.kernels and lucebox.models).
if ! "$PY" -c "import lucebox.kernels, lucebox.models" >/dev/null 2>&1 &&
   ! "$PY" -m pip install --no-deps --no-build-isolation -e . >/dev/null 2>&1; then
    ln -sfn ../kernels lucebox/kernels && ln -sfn ../models lucebox/models
    export PYTHONPATH="$PWD:${PYTHONPATH:-}"
fi
status=0
ran=0
while read -r section seconds; do
    [ -n "${DRY[*]}" ] && [ -z "${TIME_BOX:-}" ] && seconds=$((seconds * 10))  # the CPU is slower; the boxes are the GPU's
    timeout --kill-after=5 "$seconds" "$PY" bench/gpu_check.py --out "$OUT" --section "$section" ${DRY[@]+"${DRY[@]}"} \
        > "$OUT/gpu-check-logs/$section.txt" 2>&1
    rc=$?
    ran=$((ran + 1))
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        "$PY" bench/gpu_check.py --out "$OUT" --timed-out "$section"
    fi
    [ "$rc" -ne 0 ] && status=1
    echo "$section: rc=$rc"
done < <("$PY" bench/gpu_check.py --list ${SECTIONS:+--only "$SECTIONS"})
if [ "$ran" -eq 0 ]; then
    echo "no section ran (is $PY there, and does bench/gpu_check.py --list work?)" >&2
    exit 1
fi
cat "$OUT/gpu-check.json"
exit $status
