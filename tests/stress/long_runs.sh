#!/usr/bin/env bash
# Long training runs in the real pipeline (`sparkrl train`: the vLLM-CPU engine, 2 FSDP2 ranks over gloo, the
# merged weights synced every step, R3), on glibc's own allocator with core dumps on: the conditions the heap
# aborts came in, for as many trainer steps as the time allows. No checker is preloaded, so nothing changes
# the timing; a corrupted heap shows only where glibc trips over it. Two runs at once, one of each shape:
#   demo: the demo recipe on batches of 16 prompts x 8 samples, no evaluation
#   e2e:  the e2e test's shape: 4 prompts x 4 samples, PPO mini-batches of 2, a checkpoint every 2 steps and an
#         evaluation every 2 (tests/integration/conftest.py SMALL, test_train_e2e.py THREE_STEPS)
# Each shape starts its next run (a new seed) when one ends, until MINUTES have passed; with STEPS, a run ends
# after that many trainer steps (its final evaluation and export included), so a loop is many runs in a row.
# A run that fails stops the loop: its output ends with the driver's error, which for a lost trainer rank
# carries the rank's crash report (glibc's line, Ray's native stack, every thread's Python stack). A core file
# the crash left is opened with gdb, where it is installed, for every thread's native stack.
#   tests/stress/long_runs.sh [MINUTES=120] [STEPS=100000]
set -uo pipefail
cd "$(dirname "$0")/../.."
minutes=${1:-120}
steps_per_run=${2:-100000}
end=$(( $(date +%s) + 60 * minutes ))
out=$(mktemp -d)
touch "$out/.start"  # core files newer than this are this loop's
ulimit -c unlimited
echo "runs of $steps_per_run steps under $out for $minutes min; core files go to: $(cat /proc/sys/kernel/core_pattern)"

common=(monitor.k3_kl_max=0 monitor.k3_kl_trend_max=0 trainer.lr=1e-3 logging.tensorboard=false
        trainer.total_steps=$steps_per_run)
demo=(data.train_batch_size=16 eval.every=0 eval.at_start=false trainer.checkpoint_every=0)
e2e=(data.train_batch_size=4 rollout.n=4 data.arith.eval_rows=8 eval.k=4 eval.every=2
     trainer.mini_batch_size=2 trainer.checkpoint_every=2)

loop() {  # loop SHAPE OVERRIDES...: runs of one shape until the time is up; exits 1 at a failed run
  local shape=$1 i=0; shift
  while [ "$(date +%s)" -lt "$end" ]; do
    i=$((i + 1))
    local name="$shape-$i" left=$(( end - $(date +%s) ))
    # SIGTERM at the time limit (the run stops at its step), SIGKILL 2 minutes later if it has not
    timeout -k 120 "$left" .venv/bin/sparkrl train demo_cpu run.name="$name" run.dir="$out/$name" \
      run.seed="$RANDOM" "${common[@]}" "$@" > "$out/$name.out" 2>&1
    local rc=$?
    local steps
    steps=$(grep -c '"actor/pg_loss"' "$out/$name/metrics.jsonl" 2>/dev/null)
    echo "$name: ${steps:-0} trainer steps, rc=$rc$([ $rc -eq 124 ] && echo ' (time up)')"
    if [ $rc -ne 0 ] && [ $rc -ne 124 ]; then
      echo "$name failed; the end of $out/$name.out:"
      tail -n 80 "$out/$name.out"
      return 1
    fi
  done
}

loop demo "${demo[@]}" > "$out/demo.loop" 2>&1 &
demo_pid=$!
loop e2e "${e2e[@]}" > "$out/e2e.loop" 2>&1 &
e2e_pid=$!
wait $demo_pid; demo_rc=$?
wait $e2e_pid; e2e_rc=$?
cat "$out/demo.loop" "$out/e2e.loop"

cores=$(find . "$out" -maxdepth 3 -type f \( -name core -o -name 'core.[0-9]*' \) -newer "$out/.start" 2>/dev/null)
for core in $cores; do
  echo "core file $core:"
  if command -v gdb > /dev/null; then
    gdb -q -batch -ex "thread apply all bt 30" .venv/bin/python "$core" 2>&1 | grep -v "^\[New LWP" | head -400
  fi
done
total=$(cat "$out"/*.loop | awk '/trainer steps/ {n += $2} END {print n + 0}')
echo "$total trainer steps in all"
[ $demo_rc -eq 0 ] && [ $e2e_rc -eq 0 ] && [ -z "$cores" ]
