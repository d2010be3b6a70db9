#!/usr/bin/env bash
# The prepared GPU check: on one CUDA GPU of the H100/H200 class, about 8 minutes (estimated,
# not yet measured), after `pip install -r requirements.txt`. The work is in scripts/gpu_check.py (its docstring
# lists the runs); this file checks that there is a GPU and hands over.
#
# On an offline GPU image with its own torch (never reinstall it) but no deepspeed or datasets: where PyPI is
# reachable, `python scripts/gpu_wheels.py` writes .whl/ (the missing packages, ~6 MiB); on the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#       && PYTHONPATH=/tmp/site bash scripts/gpu_check.sh
#
#   bash scripts/gpu_check.sh [--work_dir DIR] [--only zero1,zero2] [--skip sdpa_compile] [--json FILE]
#   bash scripts/gpu_check.sh --cpu_test        # the same program on a CPU, tiny and fp32 (what the tests run)
#
# Prints one Markdown table; exit code 1 if a run or a check failed, 2 if there is no GPU or a flag is wrong.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
# The checkout first on the path, for an interpreter without this project installed (an offline image's own, with
# the carried packages on PYTHONPATH): scripts/gpu_check.py imports its sibling modules as `scripts.*`.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

if [[ " $* " != *" --cpu_test "* ]]; then
  command -v nvidia-smi > /dev/null || { echo "gpu_check.sh: no nvidia-smi: this needs a CUDA GPU (or --cpu_test)" >&2; exit 2; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || { echo "gpu_check.sh: $PYTHON's torch sees no CUDA GPU (a CPU wheel?); install the CUDA build" >&2; exit 2; }
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
