#!/usr/bin/env bash
# The first ten minutes on a GPU (bench/gpu_check.py says what each section checks): every section in
# its own process under its own time box, all merged into one JSON, $OUT/gpu-check.json (OUT defaults
# to bench/results), raw logs beside it in $OUT/gpu-check-logs. Under 8 minutes in all. A section cut
# short keeps what it had recorded and is marked timed_out. Nothing is fetched from the network.
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT/gpu-check-logs"
rm -f "$OUT/gpu-check.json"
# Compiled kernels survive between calls while the machine stays warm (an ignored folder of the checkout).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/bench/results/local/triton-cache}
# No registry there: no build isolation. Without pip, link the mapped packages into place
# (kernels/ and models/ install as lucebox.kernels and lucebox.models).
if ! pip install --no-deps --no-build-isolation -e . >/dev/null 2>&1; then
    ln -sfn ../kernels lucebox/kernels && ln -sfn ../models lucebox/models
    export PYTHONPATH="$PWD:${PYTHONPATH:-}"
fi
status=0
while read -r section seconds; do
    timeout "$seconds" python bench/gpu_check.py --out "$OUT" --section "$section" \
        > "$OUT/gpu-check-logs/$section.txt" 2>&1
    rc=$?
    [ "$rc" -eq 124 ] && python bench/gpu_check.py --out "$OUT" --timed-out "$section"
    [ "$rc" -ne 0 ] && status=1
    echo "$section: rc=$rc"
done < <(python bench/gpu_check.py --list)
cat "$OUT/gpu-check.json"
exit $status
