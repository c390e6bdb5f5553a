#!/usr/bin/env bash
# Set up .venv (if needed), then run a real 2-rank CPU DeepSpeed training with AdaCheck:
# save, crash, resume, and compare against DeepSpeed's native checkpoint and an uninterrupted run.
# --keep: keep the checkpoints and print the adacheck commands to try on them.
source "$(dirname "$0")/_env.sh" deepspeed   # (the demo's own arguments stay "$@")
exec "$VPY" "$ROOT/scripts/demo.py" "$@"
