#!/usr/bin/env bash
# Tiny-model smoke test for a fresh node (CPU or GPU), to run before a long job:
# each ZeRO config trains the built-in tiny Llama for a few steps; one PASS/FAIL line per config.
# A name <config>_tp<N> runs that config with --tensor_parallel_size N, <config>_pp<N> with --pipeline_parallel_size
# N (zero2_tp2 and zero1_pp2 are in the default list when the rank count is even).
#
#   bash scripts/smoke_test.sh                 # all configs, 2 ranks on CPU or every visible GPU
#   NPROC=4 bash scripts/smoke_test.sh zero3 zero1_tp2 zero1_pp2   # chosen configs and rank count
#
# PASS means: the run exited 0, every logged loss is finite and the last is below the first, a DeepSpeed
# checkpoint was written and the Hugging Face export loads. Exit code: the number of failed configs.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
# The deepspeed launcher installed beside that interpreter (a .venv here, a venv elsewhere, a conda env: wherever
# `python` runs from), else the one on PATH.
if [ -z "${DEEPSPEED:-}" ]; then
  DEEPSPEED=$("$PYTHON" -c 'import os, sys; print(os.path.join(os.path.dirname(sys.executable), "deepspeed"))') \
    || { echo "smoke_test.sh: cannot run PYTHON=$PYTHON"; exit 2; }
  [ -x "$DEEPSPEED" ] || DEEPSPEED=$(command -v deepspeed) \
    || { echo "smoke_test.sh: no deepspeed launcher beside $PYTHON or on PATH; set DEEPSPEED=/path/to/deepspeed"; exit 2; }
fi
if [ -z "${NPROC:-}" ]; then
  NPROC=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 2)")
fi
CONFIGS=("$@")
if [ ${#CONFIGS[@]} -eq 0 ]; then
  CONFIGS=(zero1 zero2 zero3 zero2_offload zero3_offload)
  [ $((NPROC % 2)) -eq 0 ] && CONFIGS+=(zero2_tp2 zero1_pp2)
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/smoke.XXXXXX")
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

failed=0
for name in "${CONFIGS[@]}"; do
  out="$WORK/$name"
  config=${name%_[tp]p*}
  layout=()
  case "$name" in
    *_tp*) layout=(--tensor_parallel_size "${name##*_tp}") ;;
    *_pp*) layout=(--pipeline_parallel_size "${name##*_pp}" --gradient_accumulation_steps "${name##*_pp}") ;;
  esac
  start=$(date +%s)
  if "$DEEPSPEED" --num_gpus "$NPROC" train.py --config "ds_configs/$config.json" --output_dir "$out" "${layout[@]}" \
       --max_steps 10 --logging_steps 2 --block_size 64 --per_device_train_batch_size 4 --learning_rate 3e-3 \
       --max_eval_samples 16 --disable_tqdm > "$out.log" 2>&1 \
     && verdict=$("$PYTHON" - "$out" <<'PY'
import math, sys
from pathlib import Path
from scaletrain.observability.metrics import read_records
run = Path(sys.argv[1])
losses = [r["loss"] for r in read_records(run / "metrics.jsonl")[0] if "loss" in r]
assert losses and all(math.isfinite(x) for x in losses), f"non-finite loss {losses}"
assert losses[-1] < losses[0], f"loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}"
assert (run / "checkpoints" / "latest").is_file(), "no checkpoint"
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging
hf_logging.disable_progress_bar()
AutoModelForCausalLM.from_pretrained(run)
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
PY
); then
    echo "PASS $name ($NPROC ranks, $(( $(date +%s) - start ))s): $verdict"
  else
    failed=$((failed + 1))
    echo "FAIL $name ($NPROC ranks): ${verdict:-training failed}; log: $out.log"
    tail -n 5 "$out.log" | sed 's/^/    /'
  fi
  verdict=""
done
echo "$(( ${#CONFIGS[@]} - failed )) passed, $failed failed"
exit $failed
