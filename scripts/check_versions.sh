#!/usr/bin/env bash
# megatron-core / Megatron-LM versions from snapshots (core_vX.Y.Z.tar.gz): the patch checks and a
# subset of the Megatron tests against each; see scripts/check_versions.py.
#   bash scripts/check_versions.sh [--json OUT.json] [--skip-installed] SNAPSHOT...
set -euo pipefail
args=()
for a in "$@"; do   # _env.sh changes into the repository: paths given relative to here
  if [[ "$a" != -* && "$a" != /* && -d "$(dirname "$a")" ]]; then
    args+=("$(cd "$(dirname "$a")" && pwd)/$(basename "$a")")
  else
    args+=("$a")
  fi
done
source "$(dirname "$0")/_env.sh" test
exec "$VPY" "$ROOT/scripts/check_versions.py" "${args[@]}"
