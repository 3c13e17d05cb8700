#!/usr/bin/env bash
# The remote calls behind docs/gpu_h200.md, one `run` each on the one-H200 machine, from the repo root
# ($OUT the folder that comes back). The kit parts (../shared/gpu/pack.sh) must have been copied to
# /tmp/kit first; `install` unpacks them once per machine. Models are built once under $ROOT/models.
#
#   bash bench/h200_calls.sh install long_prompts   # NVFP4 + LoRA + R3, prompts 128/512/2048, vLLM's
#                                                   # LoRA configs against the Hopper expand configs
#   bash bench/h200_calls.sh base_format            # trainer base nvfp4 vs bf16, both models (eager layers)
#   bash bench/h200_calls.sh qwen_kl grpo           # Qwen3-MoE KL rows; 20 GRPO steps (GRPO_BASE=bf16|nvfp4)
#
# Each step runs under `timeout` (TIMEOUT_<step> seconds) so that a call ends inside the device's 600 s and
# the rows written so far come back; each step's folder is packed into $OUT/NAME.tgz.
set -uo pipefail
ROOT=${BENCH_ROOT:-/tmp/sparkrl_bench}
mkdir -p "$ROOT/plugin"
export PYTHONPATH="$PWD:$ROOT/plugin:/tmp/site" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT0="${OUT:-./bench_out}"
mkdir -p "$OUT0"

pack() {  # pack NAME: $OUT0/NAME -> $OUT0/NAME.tgz (the device returns at most 8 files)
  tar czf "$OUT0/$1.tgz" -C "$OUT0" "$1" && rm -rf "${OUT0:?}/$1"
}

step() {  # step NAME SECONDS CMD...: CMD under timeout, its output in $OUT0/NAME/stdout.txt
  local name=$1 secs=$2
  shift 2
  mkdir -p "$OUT0/$name"
  local t0=$SECONDS
  OUT="$OUT0/$name" timeout -k 15 "$secs" "$@" >"$OUT0/$name/stdout.txt" 2>&1
  echo "== $name rc=$? $((SECONDS - t0))s"
}

for call in "$@"; do
  case $call in
  install)
    if [ ! -d /tmp/site/vllm ]; then
      t0=$SECONDS
      cat /tmp/kit/k0* | tar x -C /tmp/kit &&
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/kit/*.whl \
          >"$OUT0/install.txt" 2>&1
      echo "== install rc=$? $((SECONDS - t0))s"
    fi
    # the Muse model's vLLM plugin entry point (bench.common.ensure_vllm_plugin), for every process
    python3 -c "from bench.common import write_plugin_dist; write_plugin_dist('$ROOT/plugin')"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv >"$OUT0/gpu.txt"
    python3 -c "import torch, vllm, transformers; print(torch.__version__, torch.version.cuda, vllm.__version__, transformers.__version__)" >>"$OUT0/gpu.txt" 2>&1
    cat "$OUT0/gpu.txt"
    ;;
  long_prompts)
    step long_prompts "${TIMEOUT_long_prompts:-420}" python3 -m bench.long_prompts --out "$OUT0/long_prompts" \
      --root "$ROOT/models" --model qwen3_moe --block-n 0,32 --prompt-lens 128,512,2048
    grep -h '^long_prompts\|Using tuned LoRA\|No LoRA kernel\|Using default LoRA' "$OUT0"/long_prompts/engine_*.log | cut -c1-400
    pack long_prompts
    ;;
  base_format)
    # eager trainer layers: four trainers (two models x two formats) compile in no call's time
    # its process has touched CUDA by the time the engine starts: vLLM must spawn, not fork, its engine core
    VLLM_WORKER_MULTIPROC_METHOD=spawn step base_format "${TIMEOUT_base_format:-480}" python3 -m bench.base_format --out "$OUT0/base_format" \
      --root "$ROOT/models" --models muse,qwen3_moe --no-compile
    grep -E ' (nvfp4|bf16): base|rollout samples' "$OUT0/base_format/stdout.txt"
    rm -rf "$OUT0/base_format/stage"
    pack base_format
    ;;
  qwen_kl)
    # the NVFP4 + LoRA + R3 engine alone: KL with R3 on / off (paired per sample), the same-engine floor
    step qwen3_moe_kl "${TIMEOUT_qwen_kl:-300}" python3 -m bench.run_all --root "$ROOT" --models qwen3_moe \
      --only build,kl --engines nvfp4_lora_r3 --budget-s "${BUDGET_qwen_kl:-240}"
    grep -E '^\[' "$OUT0/qwen3_moe_kl/log.txt" | tail -12
    pack qwen3_moe_kl
    ;;
  grpo)
    # GRPO_BASE: the trainer's base (--grpo-base-format), nvfp4 by default
    base=${GRPO_BASE:-nvfp4}
    step "muse_grpo_$base" "${TIMEOUT_grpo:-480}" python3 -m bench.run_all --root "$ROOT" --models muse \
      --only build,grpo --grpo-base-format "$base" --budget-s "${BUDGET_grpo:-420}"
    grep -E 'step [0-9]+:|grpo' "$OUT0/muse_grpo_$base/log.txt" | tail -24
    pack "muse_grpo_$base"
    ;;
  *)
    echo "unknown call $call" >&2
    exit 2
    ;;
  esac
done
