#!/usr/bin/env bash
# GPU checks, on a CUDA machine: the kernel tests compiled on the GPU (CUDA-graph capture
# included), the paged-attention benchmark, then the end-to-end throughput benchmark.
#   scripts/gpu_check.sh [extra pytest args]
# Triton chooses compiled vs interpreted once per process, so the GPU run sets
# TRITON_INTERPRET=0; the CPU-interpreter run of the same tests is the ordinary `pytest`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${VIRTUAL_ENV:-.venv}/bin/python"
[ -x "$PY" ] || PY=python
"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "gpu_check.sh needs a CUDA GPU"
p = torch.cuda.get_device_properties(0)
print(f"== {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, torch {torch.__version__}")
PYEOF
export TRITON_INTERPRET=0

echo "== kernel tests on the GPU (tests/kernels)"
"$PY" -m pytest tests/kernels -q -p no:cacheprovider "$@"

echo "== paged decode attention vs SDPA"
"$PY" benchmarks/attention.py --dtype float16
"$PY" benchmarks/attention.py --dtype bfloat16

echo "== end-to-end throughput"
if [ -f benchmarks/throughput.py ]; then
    "$PY" benchmarks/throughput.py --dtype bfloat16
else
    echo "benchmarks/throughput.py is missing: skipped"
fi
