#!/usr/bin/env bash
# One call on the GPU machine: the test suite at GPU sizes, `tigon check`, then a benchmark.
# Usage (from the repository root, on the device): bash benchmarks/gpu_session.sh [tests] [check] [bench ARGS...]
#   e.g. bash benchmarks/gpu_session.sh bench e2e --model gpt_oss     (any `tigon bench` command line)
# Peers travel as wheels in .whl/ (git-ignored). Results are committed from benchmarks/results/<gpu>/:
# the bench stage writes there (`--out benchmarks/results/<gpu>` unless ARGS give an --out), and
# everything under benchmarks/results lands, packed, in $OUT when that is set.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/tigon-out}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
results="benchmarks/results/$(python3 -c 'import torch; from tigon.bench.machine import slug; print(slug(torch.cuda.get_device_name()))')"

while [ $# -gt 0 ]; do
  stage=$1; shift
  case "$stage" in
    tests) python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest.log" | tail -40 ;;
    check) python3 -m tigon.cli check 2>&1 | tee "$OUT/check.log" ;;
    bench)
      out=(--out "$results")
      for arg in "$@"; do [ "$arg" = --out ] && out=(); done
      python3 -m tigon.cli bench "$@" "${out[@]}" 2>&1 | tee "$OUT/bench.log"; break ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
tar czf "$OUT/results.tgz" benchmarks/results 2>/dev/null || true
