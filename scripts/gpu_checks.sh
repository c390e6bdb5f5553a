#!/usr/bin/env bash
# The checks only a GPU can run, in one pass (a session lent a CUDA machine runs this):
#   tests         the CUDA tests (staging events, online deltas' copies, DeepSpeed on CUDA with
#                 NCCL: async saves by a writer process and a thread, a sync save, online deltas,
#                 loads in other ZeRO stages exact against DeepSpeed's own accessors, continued
#                 training with the uninterrupted losses; scripts/pretrain_gpt.py resumes);
#   cpu_tests     CPU tests that spawn ranks (CUDA hidden from them) on a machine with a GPU;
#   megatron_lm   Megatron-LM's own pretrain_gpt.py with --adacheck --async-save, stop and resume
#                 (scripts/check_megatron_lm.py; needs $MEGATRON_LM and $MEGATRON_LM_PATCHED, trees
#                 of core_v0.16.1 without and with patches/megatron-lm-core_v0.16.1.patch);
#   bench_ds, bench_ds_2gb   sync saves and verified loads against DeepSpeed's own, with their
#                 phases (ZeRO 1-3, fp32 and bf16 at 252 MB; ZeRO 1 and 3, bf16 at 2 GB);
#   bench_async, bench_online, bench_tiers   the benchmarks on the GPU (pinned staging; bench_online
#                 with a third engine whose deltas go to the memory tier);
#   bench_online_throttled   the same with the checkpoint directory throttled to $GPU_DURABLE_MBPS
#                 (default 520 MB/s: what one H100 machine's disk absorbed of Megatron-LM's deltas).
# GPU_PARTS picks and orders them (default: all). Results (logs, JSON) go to $1 (default
# ./gpu_out).  Each part has its own time limit and a failure does not stop the next.  PYTHON
# defaults to python3; it needs torch with CUDA, deepspeed and this project's dependencies
# (PYTHONPATH may point at them).  The parts' limits add up to far more than one lent
# machine's command may run: pick parts, and limits that fit it, e.g. issue 60's tables:
#   GPU_PARTS="bench_ds bench_ds_2gb bench_tiers" GPU_DS_S=200 GPU_DS_2GB_S=250 GPU_TIERS_S=120 \
#     bash scripts/gpu_checks.sh "$OUT"       # (limits: 570 s)
set -u
OUT_DIR=${1:-gpu_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
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
  df -h "$WORK" /tmp /dev/shm | tail -n 3; nproc; command -v make g++ python3-config; } 2>&1 | tee "$OUT_DIR/machine.txt"
for p in ${GPU_PARTS:-tests cpu_tests megatron_lm bench_ds bench_ds_2gb bench_async bench_online bench_online_throttled bench_tiers}; do case $p in
tests) part tests "${GPU_TESTS_S:-400}" $PY -m pytest -q -p no:cacheprovider -rs \
  ${GPU_TESTS:-tests/test_core_staging.py tests/test_core_deltas.py tests/test_ds_cuda.py tests/test_megatron_cuda.py} ;;
cpu_tests) part cpu_tests "${GPU_CPU_TESTS_S:-300}" $PY -m pytest -q -p no:cacheprovider -rs \
  ${GPU_CPU_TESTS:-tests/test_megatron.py} ;;
megatron_lm) part megatron_lm "${GPU_MLM_S:-300}" $PY scripts/check_megatron_lm.py --tree "${MEGATRON_LM:-}" \
  --patched-tree "${MEGATRON_LM_PATCHED:-}" --out "$OUT_DIR/megatron_lm" ;;
bench_ds) part bench_ds "${GPU_DS_S:-240}" $PY scripts/bench_ds.py --device cuda --dp 1 --stages 1 2 3 \
  --dtypes fp32 bf16 --repeat 3 --work "$WORK/ds" --json "$OUT_DIR/bench_ds.json" ;;
bench_ds_2gb) part bench_ds_2gb "${GPU_DS_2GB_S:-300}" $PY scripts/bench_ds.py --device cuda --dp 1 --stages 1 3 \
  --dtypes bf16 --repeat 2 --vocab 32000 --dim 1024 --layers 8 --work "$WORK/ds2" --json "$OUT_DIR/bench_ds_2gb.json" ;;
bench_async) part bench_async "${GPU_ASYNC_S:-150}" $PY scripts/bench_async.py --device cuda --dp 1 --stages 1 3 \
  --dtypes bf16 --repeat 2 --saves 10 --busy-saves 3 --work "$WORK/async" --json "$OUT_DIR/bench_async.json" ;;
bench_online) part bench_online "${GPU_ONLINE_S:-180}" $PY scripts/bench_online.py --device cuda --dp 1 --stages 1 2 \
  --dtypes bf16 fp32 --blocks 6 --tiers --work "$WORK/online" --json "$OUT_DIR/bench_online.json" ;;
bench_online_throttled) part bench_online_throttled "${GPU_ONLINE_S:-180}" $PY scripts/bench_online.py --device cuda \
  --dp 1 --stages 1 --dtypes fp32 bf16 --blocks 6 --tiers --durable-mbps "${GPU_DURABLE_MBPS:-520}" \
  --work "$WORK/online_throttled" --json "$OUT_DIR/bench_online_throttled.json" ;;
bench_tiers) part bench_tiers "${GPU_TIERS_S:-150}" $PY scripts/bench_tiers.py --device cuda --dp 1 --stages 1 3 \
  --dtypes bf16 --repeat 2 --memory-dir "${GPU_MEMORY_DIR:-/dev/shm/adacheck-bench}" --work "$WORK/tiers" \
  --json "$OUT_DIR/bench_tiers.json" ;;
*) echo "[gpu_checks] unknown part $p" ;;
esac; done
rm -rf "$WORK"
