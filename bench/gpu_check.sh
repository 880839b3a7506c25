#!/usr/bin/env bash
# One GPU session: kernel tests (bf16 included), CUDA-graph replay, then bench/kernels.py.
# Results go to $OUT (default bench/results); nothing is fetched from the network. Fits one
# 600-second device call (tests 200 s, benchmark 360 s; the benchmark writes its JSON after
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
timeout 200 python -m pytest -q -x tests/test_kernels.py tests/test_cuda_graphs.py \
    -k "not segments_chain and not need_cuda_and_triton and not never_sync" \
    --junitxml "$OUT/gpu-tests.xml" > "$OUT/gpu-tests.txt" 2>&1
echo "tests rc=$?" >> "$OUT/gpu.txt"
timeout 360 python bench/kernels.py --out "$OUT" --decode-tokens 64 > "$OUT/kernels-bench.txt" 2>&1
echo "bench rc=$?" >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"; tail -20 "$OUT/gpu-tests.txt"; tail -20 "$OUT/kernels-bench.txt"
