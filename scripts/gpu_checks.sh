#!/usr/bin/env bash
# The checks only a GPU can run, in one pass (a session lent a CUDA machine runs this):
#   1. the CUDA tests (staging events, online deltas' copies, DeepSpeed on CUDA with NCCL:
#      async saves by a writer process and a thread, a sync save, online deltas, loads in other
#      ZeRO stages: exact against DeepSpeed's own accessors);
#   2. bench_async.py and bench_online.py on the GPU (pinned staging), as on the CPU.
# Results (logs, JSON) go to $1 (default ./gpu_out).  Each part has its own time limit and a
# failure does not stop the next.  PYTHON defaults to python3; it needs torch with CUDA,
# deepspeed and this project's dependencies (PYTHONPATH may point at them).
set -u
OUT_DIR=${1:-gpu_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
WORK=${GPU_WORK:-$ROOT/.gpu_work}
mkdir -p "$WORK"
part() {   # part NAME SECONDS CMD...: run it, log to OUT_DIR/NAME.log, say how it ended
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  echo "[gpu_checks] $name: exit $? after $((SECONDS - t0)) s"
  tail -n 25 "$OUT_DIR/$name.log"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, deepspeed; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'deepspeed', deepspeed.__version__)"
  df -h "$WORK" /tmp | tail -n 2; nproc; } 2>&1 | tee "$OUT_DIR/machine.txt"
part tests "${GPU_TESTS_S:-200}" $PY -m pytest -q -p no:cacheprovider -rs \
  tests/test_core_staging.py tests/test_core_deltas.py tests/test_ds_cuda.py
part bench_async "${GPU_ASYNC_S:-150}" $PY scripts/bench_async.py --device cuda --dp 1 --stages 1 3 \
  --dtypes bf16 --repeat 2 --saves 10 --busy-saves 3 --work "$WORK/async" --json "$OUT_DIR/bench_async.json"
part bench_online "${GPU_ONLINE_S:-110}" $PY scripts/bench_online.py --device cuda --dp 1 --stages 1 2 \
  --dtypes bf16 fp32 --work "$WORK/online" --json "$OUT_DIR/bench_online.json"
rm -rf "$WORK"
