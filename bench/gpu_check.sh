#!/usr/bin/env bash
# One GPU session: kernel tests (bf16 included), the one-graph step's capture and replay at every
# width (tests/test_cuda_graphs.py), then bench/kernels.py: kernels, whole-model decode, and
# dummy Laguna XS.2 at int4 under a 24 GiB budget (--vram) decoding at 1K, 32K and 128K of context with
# its peak memory.
# Results go to $OUT (default bench/results); nothing is fetched from the network. Fits one
# 600-second device call (tests 150 s, benchmark 420 s; the benchmark writes its JSON after
# every section, so a timeout keeps what was measured).
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
# No registry there: no build isolation. Without pip, link the mapped packages into place
# (kernels/ and models/ install as lucebox.kernels and lucebox.models).
if ! pip install --no-deps --no-build-isolation -e . >/dev/null 2>&1; then
    ln -sfn ../kernels lucebox/kernels && ln -sfn ../models lucebox/models
    export PYTHONPATH="$PWD:${PYTHONPATH:-}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt" 2>&1
timeout 150 python -m pytest -q -x tests/test_kernels.py tests/test_cuda_graphs.py \
    -k "not graphed_steps_equal_the_plain and not need_cuda_and_triton and not never_syncs" \
    --junitxml "$OUT/gpu-tests.xml" > "$OUT/gpu-tests.txt" 2>&1
echo "tests rc=$?" >> "$OUT/gpu.txt"
timeout 420 python bench/kernels.py --out "$OUT" --decode-tokens 64 --contexts 1024,32768,131072 --vram 24GiB \
    > "$OUT/kernels-bench.txt" 2>&1
echo "bench rc=$?" >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"; tail -20 "$OUT/gpu-tests.txt"; tail -20 "$OUT/kernels-bench.txt"
