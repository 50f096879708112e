#!/usr/bin/env bash
# GPU checks, on a CUDA machine: the kernel tests compiled on the GPU (CUDA-graph capture
# included), the paged-attention benchmark, then the end-to-end throughput benchmark.
#   scripts/gpu_check.sh [extra pytest args]      THROUGHPUT_ARGS="--model DIR" to pick a model
# Triton chooses compiled vs interpreted once per process, so the GPU run sets
# TRITON_INTERPRET=0; the CPU-interpreter run of the same tests is the ordinary `pytest`.
# Test files run in parallel processes (kernel compiles dominate); every step runs even if an
# earlier one fails, and the exit status says whether all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${VIRTUAL_ENV:-.venv}/bin/python"
[ -x "$PY" ] || PY=python
"$PY" - <<'PYEOF' || exit 2
import torch
assert torch.cuda.is_available(), "gpu_check.sh needs a CUDA GPU"
p = torch.cuda.get_device_properties(0)
print(f"== {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, torch {torch.__version__}")
PYEOF
export TRITON_INTERPRET=0 TRITON_DEFAULT_FP_FUSION=1
status=0
logdir=$(mktemp -d)

echo "== kernel tests on the GPU (tests/kernels, one process per file)"
files=(tests/kernels/test_*.py)
pids=()
for f in "${files[@]}"; do
    "$PY" -m pytest "$f" -q -p no:cacheprovider "$@" >"$logdir/$(basename "$f").log" 2>&1 &
    pids+=($!)
done
for i in "${!files[@]}"; do
    wait "${pids[$i]}" || status=1
    echo "-- ${files[$i]}"
    tail -n 30 "$logdir/$(basename "${files[$i]}").log"
done

echo "== paged decode attention vs SDPA"
"$PY" benchmarks/attention.py --dtype float16 || status=1
"$PY" benchmarks/attention.py --dtype bfloat16 || status=1

echo "== end-to-end throughput"
if [ -f benchmarks/throughput.py ]; then
    # shellcheck disable=SC2086
    "$PY" benchmarks/throughput.py --dtype bfloat16 ${THROUGHPUT_ARGS:-} || status=1
else
    echo "benchmarks/throughput.py is missing: skipped"
fi
echo "== gpu_check: $([ $status -eq 0 ] && echo PASSED || echo FAILED)"
exit $status
