#!/usr/bin/env bash
# One GPU session: kernel tests (bf16 included), CUDA-graph replay, then bench/kernels.py.
# Results go to $OUT (default bench/results); nothing is fetched from the network.
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
pip install --no-deps -e . >/dev/null 2>&1 || export PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt" 2>&1
timeout 240 python -m pytest -q -x tests/test_kernels.py tests/test_cuda_graphs.py -k "not segments_chain and not need_cuda_and_triton" \
    --junitxml "$OUT/gpu-tests.xml" > "$OUT/gpu-tests.txt" 2>&1
echo "tests rc=$?" >> "$OUT/gpu.txt"
timeout 300 python bench/kernels.py --out "$OUT" > "$OUT/kernels-bench.txt" 2>&1
echo "bench rc=$?" >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"; tail -20 "$OUT/gpu-tests.txt"; tail -20 "$OUT/kernels-bench.txt"
