#!/usr/bin/env bash
# Start the Ray head node of a sparkrl cluster, with the environment vLLM and NCCL need.
#
#   launch/head.sh [extra `ray start` arguments]
#
# Knobs (environment; defaults in brackets):
#   SPARKRL_VENV     venv whose ray and python the cluster runs [<checkout>/.venv]
#   RAY_PORT         GCS port the workers join [6379]
#   DASHBOARD_PORT   dashboard and job server [8265]
#   DASHBOARD_HOST   address the dashboard binds [127.0.0.1]: reach it through an SSH tunnel
#                    (ssh -L 8265:127.0.0.1:8265 head), or set 0.0.0.0 on a trusted network
#   NODE_IP          this node's address as the workers see it [Ray's guess]
#   NUM_GPUS         GPUs Ray may schedule on this node [all it finds]
#   RAY_AUTH_MODE    token [token]: every client needs the cluster's token; `disabled` only on a
#                    machine nobody else can reach
#   BLOCK            1 = stay in the foreground (containers, systemd) [0]
#
# Sourced (as launch/worker.sh does), it only defines sparkrl_env.
set -euo pipefail

sparkrl_env() {
    # The venv first on PATH: Ray runs a job's entrypoint and its workers with the `python` it finds, so
    # this makes `sparkrl submit --python python` and plain `ray job submit -- python ...` use the venv.
    local checkout
    checkout="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    SPARKRL_VENV="${SPARKRL_VENV:-$checkout/.venv}"
    if [[ ! -x "$SPARKRL_VENV/bin/ray" ]]; then
        echo "launch: no ray in $SPARKRL_VENV (set SPARKRL_VENV to the venv with sparkrl installed)" >&2
        return 1
    fi
    export PATH="$SPARKRL_VENV/bin:$PATH"

    # Token authentication: a Ray cluster otherwise runs any code anyone who can reach it sends.
    export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

    # NVLink multicast (NVLS) off: on GPUs shared with others it can put the whole host's GPUs out of
    # service; the bandwidth it adds does not matter for LoRA-sized all-reduces.
    export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
    export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
    export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
    # NCCL's cuMem buffers cost 1-2 GiB a GPU with CUDA graphs + all-reduce (NVIDIA/nccl#1234); vLLM
    # turns them off in its own processes; off for the trainer's NCCL too, which shares the GPUs.
    export NCCL_CUMEM_ENABLE="${NCCL_CUMEM_ENABLE:-0}"
    # FSDP2: free collective buffers when their stream is done rather than via record_stream (less
    # memory held across the step).
    export TORCH_NCCL_AVOID_RECORD_STREAMS="${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}"
    export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
    # Multi-node: NCCL_SOCKET_IFNAME / NCCL_IB_HCA pass through when set; NCCL picks otherwise.
    # Not set on purpose: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which vLLM's sleep mode
    # rejects.

    # vLLM engines start inside Ray actors that have already touched CUDA: fork would break them.
    export VLLM_WORKER_MULTIPROC_METHOD="${VLLM_WORKER_MULTIPROC_METHOD:-spawn}"
    # Tokenizers in forked reward/data workers would otherwise warn and disable themselves mid-run.
    export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
    export PYTHONUNBUFFERED=1

    # Many worker processes, many sockets.
    ulimit -n 65536 2>/dev/null || true
}

ensure_token() {
    # Ray reads the token from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; workers and
    # clients need the same one.
    [[ "$RAY_AUTH_MODE" == "token" ]] || return 0
    if [[ -z "${RAY_AUTH_TOKEN:-}" && -z "${RAY_AUTH_TOKEN_PATH:-}" && ! -s "$HOME/.ray/auth_token" ]]; then
        ray get-auth-token --generate >/dev/null
        echo "launch: generated a cluster token in ~/.ray/auth_token; give it to workers and clients" \
             "(RAY_AUTH_TOKEN=\$(ray get-auth-token))" >&2
    fi
}

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
    return 0
fi

sparkrl_env
ensure_token

args=(start --head
      --port="${RAY_PORT:-6379}"
      --dashboard-port="${DASHBOARD_PORT:-8265}"
      --dashboard-host="${DASHBOARD_HOST:-127.0.0.1}"
      --disable-usage-stats)
[[ -n "${NODE_IP:-}" ]] && args+=(--node-ip-address="$NODE_IP")
[[ -n "${NUM_GPUS:-}" ]] && args+=(--num-gpus="$NUM_GPUS")
[[ "${BLOCK:-0}" == "1" ]] && args+=(--block)

ray "${args[@]}" "$@"

if [[ "${BLOCK:-0}" != "1" ]]; then
    cat <<EOF
launch: head up. Workers: launch/worker.sh <this node's IP>:${RAY_PORT:-6379}
launch: submit from here: RAY_ADDRESS=http://127.0.0.1:${DASHBOARD_PORT:-8265} RAY_AUTH_MODE=$RAY_AUTH_MODE \\
          sparkrl submit recipes/<recipe>.yaml [key=value ...]
EOF
fi
