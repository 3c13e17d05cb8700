#!/usr/bin/env bash
# The remote calls that made the figures in docs/benchmarks.md, one `run` each on the GPU machine (repo
# root as working directory, $OUT the folder that comes back). The kit parts (../shared/gpu/pack.sh) must
# have been copied to /tmp/kit first; `install` unpacks them once per machine.
#
#   bash bench/gpu_calls.sh install tests      # vLLM kit, then the gpu-marked tests of issues 5 and 9
#   bash bench/gpu_calls.sh r3                 # Muse: NVFP4+LoRA with and without R3: rollout, KL
#   bash bench/gpu_calls.sh r3pair             # the same, the two engines' rollout run in alternation
#   bash bench/gpu_calls.sh seeds              # the cost of per-request seeds (pair with an unseeded engine)
#   bash bench/gpu_calls.sh r3stream           # NVFP4+LoRA against R3 as vLLM streams it, in alternation
#   bash bench/gpu_calls.sh r3pair12           # batches 256 and 64 only: 12 pairs, 256 generated tokens
#   bash bench/gpu_calls.sh r3profile          # batch 256, 2 pairs in alternation, then one batch each profiled
#   bash bench/gpu_calls.sh r3control          # the same for nvfp4_lora against itself (the A/A pair)
#   bash bench/gpu_calls.sh r3pin              # NVFP4+LoRA against R3, 4 pairs, both pinned to the GPU's cores
#   bash bench/gpu_calls.sh r3orders           # R3 pairs, 6 each, in two calls: NVFP4+LoRA started first, R3 first
#   bash bench/gpu_calls.sh r3short_plain      # 24 pairs of 128 generated tokens, NVFP4+LoRA started first
#   bash bench/gpu_calls.sh r3short_r3         # ... R3 started first
#   bash bench/gpu_calls.sh machine            # cores, NUMA nodes, GPU topology, cgroup limits -> machine.txt
#   bash bench/gpu_calls.sh trainer            # trainer tokens/s, MFU, memory: Muse (trainer_qwen: Qwen3-MoE)
#   bash bench/gpu_calls.sh qwen_r3            # Qwen3-MoE: NVFP4+LoRA and +R3 in alternation; KL R3 on/off
#   bash bench/gpu_calls.sh qwen_kl            # Qwen3-MoE: R3 engine alone, KL R3 on/off, same-engine floor
#   bash bench/gpu_calls.sh qwen_r3short_plain # Qwen3-MoE: 16 R3 pairs at batch 256 (_r3: R3 started first)
#   bash bench/gpu_calls.sh r3conc_plain       # two GPUs: the R3 pair at once, one GPU each (_r3: R3 on GPU 0)
#   bash bench/gpu_calls.sh qwen_r3conc_plain  # ... Qwen3-MoE (qwen_r3conc_r3: R3 on GPU 0)
#   bash bench/gpu_calls.sh qwen_bf16          # Qwen3-MoE: BF16 (rollout, KL floors), BF16+LoRA
#   bash bench/gpu_calls.sh qwen_sync          # Qwen3-MoE: adapter sync, rank 8/32, attention/all experts
#   bash bench/gpu_calls.sh trainer_qwen32     # Qwen3-MoE trainer, 32k-token micro-batches, budget 0.5
#   bash bench/gpu_calls.sh trainer32          # the same at 32k-token micro-batches: memory budget 0.5, AC on
#   bash bench/gpu_calls.sh trainer32off       # ... AC off, memory budget 0.25
#   bash bench/gpu_calls.sh lora_experts       # the trainer's compute alone (bench/lora_experts.py), no kit
#   bash bench/gpu_calls.sh lora_experts_ac    # ... compiled layers: whole-layer AC, budget 0.5, none
#   bash bench/gpu_calls.sh bf16               # Muse: BF16 and BF16+LoRA engines: rollout, KL floors
#   bash bench/gpu_calls.sh sync grpo          # Muse: adapter sync rows (both layouts); the 20-step GRPO run
#
# Plan for the next GPU time (not run in the eleventh session: 252 s of issue 11's device time were left and
# the two-GPU machine was withheld). The two-GPU machine (`run` with kind nvidia-h200-x2): the kit, then alone
# each, wrapped in `timeout -s ABRT 570`: `install r3conc_plain`, `r3conc_r3` (Muse's R3 pair at once, one GPU
# each: the concurrent pool gives the verdict, decided before they ran: docs/benchmarks.md, tenth session),
# `qwen_kl` (the paired KL interval; where the NVFP4 engine's prefill log-probs go NaN), `qwen_r3conc_plain`,
# `qwen_r3conc_r3`. The tenth session ran the Qwen3-MoE calls on one GPU: qwen_r3, trainer_qwen32, qwen_sync,
# qwen_kl, qwen_bf16, qwen_r3short_r3, qwen_r3short_plain.
#
# One engine per process (a second vLLM engine started in the same process after the first shut down
# hung at start on vLLM 0.26); each process writes its own folder under $OUT, and
# `python -m bench.summarize $OUT/*` merges them (each folder comes back packed as NAME.tgz).
#
# On the two-GPU machine two calls can run side by side, each on its own GPU and model folder (two
# processes building the same model folder at once would collide):
#   CUDA_VISIBLE_DEVICES=0 bash bench/gpu_calls.sh r3pair & CUDA_VISIBLE_DEVICES=1 BENCH_ROOT=/tmp/sb1 \
#     bash bench/gpu_calls.sh trainer & wait
# Only for GPU-bound calls (trainer, lora_experts): rollout and sync are paced by the host, and beside
# another call's engine start the sync's export ran 7x slower and the R3 pairs drifted (docs/benchmarks.md).
set -uo pipefail
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT0="${OUT:-./bench_out}"
mkdir -p "$OUT0"
bench() {  # bench NAME ARGS...: one bench.run_all process writing $OUT0/NAME
  local name=$1
  shift
  mkdir -p "$OUT0/$name"
  OUT="$OUT0/$name" python3 -m bench.run_all --root "${BENCH_ROOT:-/tmp/sparkrl_bench}" "$@" \
    >"$OUT0/$name/stdout.txt" 2>&1
  echo "== $name rc=$?"
  grep -E '^\[' "$OUT0/$name/log.txt" | tail -40
  # One archive per call: the device returns only so many files from $OUT (a whole folder of JSON was
  # left behind once). bench.summarize reads the archives as they are.
  # Profiler traces of a whole batch run to hundreds of MB: the tables beside them stay.
  find "$OUT0/$name" -name '*.trace.json.gz' -size +20M -delete
  tar czf "$OUT0/$name.tgz" -C "$OUT0" "$name" && rm -rf "${OUT0:?}/$name"
}

r3_pair_call() {  # r3_pair_call NAME FIRST PAIRS OUTPUT_LEN BUDGET_S [MODEL]: the R3 pair at batch 256, FIRST
  # (plain or r3) started first, on MODEL (muse by default)
  local name=$1 first=$2 pairs=$3 len=$4 budget=$5 model=${6:-muse} pair=nvfp4_lora,nvfp4_lora_r3
  [ "$first" = r3 ] && pair=nvfp4_lora_r3,nvfp4_lora
  bench "${name}_${first}first" --models "$model" --only build,rollout --engines $pair --rollout-pair $pair \
    --pair-repeats "$pairs" --output-len "$len" --batch-sizes 256 --budget-s "$budget"
}

r3_conc_call() {  # r3_conc_call NAME FIRST PAIRS OUTPUT_LEN BUDGET_S MODEL: the R3 pair at batch 256 on the two-GPU
  # machine, both engines at once, one GPU each; FIRST (plain or r3) has GPU 0 (and is started first)
  local name=$1 first=$2 pairs=$3 len=$4 budget=$5 model=$6 pair=nvfp4_lora,nvfp4_lora_r3
  [ "$first" = r3 ] && pair=nvfp4_lora_r3,nvfp4_lora
  bench "${name}_${first}gpu0" --models "$model" --only build,rollout --engines $pair --rollout-pair $pair \
    --pair-concurrent --pair-repeats "$pairs" --output-len "$len" --batch-sizes 256 --budget-s "$budget"
}

r3_both_orders() {  # r3_both_orders NAME PAIRS OUTPUT_LEN BUDGET_S: the R3 pair, one run per start order
  # (the engine started second ran slower in an A/A pair; bench.pairstats.pooled_cost pools both calls' pairs)
  r3_pair_call "$1" plain "$2" "$3" "$4"
  r3_pair_call "$1" r3 "$2" "$3" "$4"
}

for call in "$@"; do
  case $call in
  install)
    if [ ! -d /tmp/site/vllm ]; then
      cat /tmp/kit/k0* | tar x -C /tmp/kit &&
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/kit/*.whl \
          >"$OUT0/install.txt" 2>&1
      echo "== install rc=$?"
    fi
    ;;
  tests)
    VLLM_WORKER_MULTIPROC_METHOD=spawn python3 -m pytest -m gpu -q -s -p no:cacheprovider \
      tests/integration/test_rollout_gpu.py tests/integration/test_muse_gpu.py >"$OUT0/tests_gpu.txt" 2>&1
    echo "== tests rc=$?"
    grep -E '^(PASSED|FAILED|ERROR)|passed|failed|dlogp|gap|sleep' "$OUT0/tests_gpu.txt" | tail -30
    ;;
  r3)
    bench muse_nvfp4_lora_r3 --models muse --only build,rollout,kl --engines nvfp4_lora_r3 --budget-s 300
    bench muse_nvfp4_lora --models muse --only rollout --engines nvfp4_lora --budget-s 170
    ;;
  r3pair)
    bench muse_r3pair --models muse --only build,rollout,kl --engines nvfp4_lora,nvfp4_lora_r3 \
      --rollout-pair nvfp4_lora,nvfp4_lora_r3 --budget-s 470
    ;;
  r3pair12)
    bench muse_r3pair12 --models muse --only build,rollout --engines nvfp4_lora,nvfp4_lora_r3 \
      --rollout-pair nvfp4_lora,nvfp4_lora_r3 --pair-repeats 12 --output-len 256 --batch-sizes 256,64 \
      --budget-s 470
    ;;
  r3profile)
    bench muse_r3profile --models muse --only build,rollout --engines nvfp4_lora,nvfp4_lora_r3 \
      --rollout-pair nvfp4_lora,nvfp4_lora_r3 --pair-repeats 2 --output-len 256 --batch-sizes 256 \
      --rollout-profile --budget-s 500
    ;;
  r3pin)
    # both engines pinned to the cores of the GPU's NUMA node (bench/paired.py: BENCH_PIN_CPUS)
    BENCH_PIN_CPUS=local bench muse_r3pin --models muse --only build,rollout --engines nvfp4_lora,nvfp4_lora_r3 \
      --rollout-pair nvfp4_lora,nvfp4_lora_r3 --pair-repeats 4 --output-len 256 --batch-sizes 256 --budget-s 400
    ;;
  r3orders)
    r3_both_orders muse_r3 6 256 280
    ;;
  r3short_plain | r3short_r3)
    # one start order a call, 24 pairs of 128 generated tokens: both orders in one call do not fit 570 s on
    # a fresh machine, whose first engine start compiles for ~100 s (the ninth session)
    r3_pair_call muse_r3short "${call#r3short_}" 24 128 480
    ;;
  machine)
    {
      lscpu
      echo "== affinity: $(python3 -c 'import os; print(sorted(os.sched_getaffinity(0)))')"
      echo "== cgroup cpu.max: $(cat /sys/fs/cgroup/cpu.max 2>/dev/null)"
      echo "== cpuset: $(cat /sys/fs/cgroup/cpuset.cpus.effective 2>/dev/null)"
      nvidia-smi topo -m
      nvidia-smi --query-gpu=pci.bus_id,clocks.sm,clocks.max.sm,power.draw --format=csv
      for n in /sys/devices/system/node/node*; do echo "$n: $(cat "$n/cpulist")"; done
    } >"$OUT0/machine.txt" 2>&1
    grep -E "Model name|Socket|NUMA|affinity|cpu.max|cpuset|GPU0|node" "$OUT0/machine.txt" | head -20
    ;;
  r3control)
    # the A/A pair: nvfp4_lora against itself in another process, as r3profile runs (what pairs read as a
    # cost where there is none; profiled, how much slower the same host ops run in one engine process)
    bench muse_r3control --models muse --only build,rollout --engines nvfp4_lora,nvfp4_lora_twin \
      --rollout-pair nvfp4_lora,nvfp4_lora_twin --pair-repeats 2 --output-len 256 --batch-sizes 256 \
      --rollout-profile --budget-s 500
    ;;
  seeds)
    # per-request seeds against none (rollout.seed_scope engine), batch 256 and 64
    bench muse_seeds --models muse --only build,rollout --engines nvfp4_lora,nvfp4_lora_unseeded \
      --rollout-pair nvfp4_lora,nvfp4_lora_unseeded --pair-repeats 6 --output-len 256 --batch-sizes 256,64 \
      --budget-s 470
    ;;
  r3stream)
    bench muse_r3stream --models muse --only build,rollout --engines nvfp4_lora,nvfp4_lora_r3_stream \
      --rollout-pair nvfp4_lora,nvfp4_lora_r3_stream --budget-s 330
    ;;
  trainer)
    # compiled trainer (its GPU default): the first step compiles for about two minutes
    bench muse_trainer --models muse --only build,trainer --train-micro-tokens 16384 --train-ac on,off --budget-s 480
    ;;
  trainer32)
    # 32k-token micro-batches: the partitioner's memory budget first (new), then whole-layer AC
    bench muse_trainer32 --models muse --only build,trainer --train-micro-tokens 32768 --train-ac 0.5,on \
      --budget-s 470
    ;;
  trainer32off)
    bench muse_trainer32off --models muse --only build,trainer --train-micro-tokens 32768 --train-ac off,0.25 \
      --budget-s 470
    ;;
  qwen_r3)
    # Qwen3-MoE: NVFP4+LoRA and NVFP4+LoRA+R3 in alternation at every batch size (one after the other, the
    # host's drift would decide the R3 figure), then KL with the trainer replaying the routing and not
    bench qwen3_moe_r3pair --models qwen3_moe --only build,rollout,kl --engines nvfp4_lora,nvfp4_lora_r3 \
      --rollout-pair nvfp4_lora,nvfp4_lora_r3 --budget-s 480
    ;;
  qwen_kl)
    # Qwen3-MoE: NVFP4+LoRA+R3 alone (rollout), its samples scored by the trainer with R3 and without, and the
    # same-engine floor (qwen_r3's pairs leave too little of its budget for the KL on a fresh machine)
    bench qwen3_moe_kl --models qwen3_moe --only build,rollout,kl --engines nvfp4_lora_r3 --budget-s 320
    ;;
  qwen_r3short_plain | qwen_r3short_r3)
    # Qwen3-MoE's R3 pair at batch 256 only: 16 pairs of 128 generated tokens, one start order a call
    r3_pair_call qwen3_moe_r3short "${call#qwen_r3short_}" 16 128 400 qwen3_moe
    ;;
  r3conc_plain | r3conc_r3 | qwen_r3conc_plain | qwen_r3conc_r3)
    # two-GPU machine: the R3 pair at once, one GPU each, 24 pairs of 128 generated tokens; _plain gives
    # NVFP4+LoRA GPU 0, _r3 gives it to R3 (a call of each balances the two GPUs, bench.pairstats.pooled_cost)
    model=muse
    [ "${call#qwen_}" != "$call" ] && model=qwen3_moe
    r3_conc_call "${model}_r3conc" "${call##*_}" 24 128 400 "$model"
    ;;
  qwen_bf16)
    # Qwen3-MoE: BF16 (rollout, KL floors), BF16+LoRA (rollout)
    bench qwen3_moe_bf16 --models qwen3_moe --only build,rollout,kl --engines bf16 --budget-s 260
    bench qwen3_moe_bf16_lora --models qwen3_moe --only rollout --engines bf16_lora --budget-s 230
    ;;
  qwen_sync)
    # Qwen3-MoE: adapter sync, rank 8 and 32, attention-only and all experts, the stacked layout (the default)
    bench qwen3_moe_sync --models qwen3_moe --only build,sync --engines nvfp4_lora_stacked \
      --sync-cases 8:attn,8:all,32:attn,32:all --sync-repeats 5 --budget-s 420
    ;;
  trainer_qwen32)
    # Qwen3-MoE trainer at the Muse figure's setting: 32k-token micro-batches, memory budget 0.5
    bench qwen3_moe_trainer32 --models qwen3_moe --only build,trainer --train-micro-tokens 32768 --train-ac 0.5 \
      --budget-s 470
    ;;
  trainer_qwen)
    bench qwen3_moe_trainer --models qwen3_moe --only build,trainer --train-micro-tokens 16384 --budget-s 480
    ;;
  lora_experts)
    # no kit needed: torch + transformers + PEFT only
    mkdir -p "$OUT0/lora_experts"
    OUT="$OUT0/lora_experts" python3 -m bench.lora_experts --models muse --paths grouped --ac on,off \
      --compile none,layers >"$OUT0/lora_experts/stdout.txt" 2>&1
    echo "== lora_experts rc=$?"
    grep -E 'tok/s' "$OUT0/lora_experts/log.txt"
    ;;
  lora_experts_ac)
    mkdir -p "$OUT0/lora_experts_ac"
    OUT="$OUT0/lora_experts_ac" python3 -m bench.lora_experts --models muse --paths grouped --ac on,0.5,off \
      --compile layers --steps 3 --warmup 2 >"$OUT0/lora_experts_ac/stdout.txt" 2>&1
    echo "== lora_experts_ac rc=$?"
    grep -E 'tok/s' "$OUT0/lora_experts_ac/log.txt"
    ;;
  bf16)
    bench muse_bf16 --models muse --only build,rollout,kl --engines bf16 --budget-s 260
    bench muse_bf16_lora --models muse --only rollout --engines bf16_lora --budget-s 230
    ;;
  sync)
    # per-expert adapter files, then the stacked layout vLLM splits itself (EngineSpec.lora_experts_stacked)
    bench muse_sync --models muse --only build,sync --engines nvfp4_lora,nvfp4_lora_stacked \
      --sync-cases 32:all,32:attn --sync-repeats 5 --budget-s 420
    ;;
  grpo)
    bench muse_grpo --models muse --only build,grpo --budget-s 420
    ;;
  *)
    echo "unknown call $call" >&2
    exit 2
    ;;
  esac
done
