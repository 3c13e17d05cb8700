#!/usr/bin/env bash
# Join a worker node to a sparkrl Ray cluster started by launch/head.sh, with the same environment.
#
#   launch/worker.sh HEAD_IP:PORT [extra `ray start` arguments]
#
# Knobs: SPARKRL_VENV, NODE_IP, NUM_GPUS, RAY_AUTH_MODE, BLOCK, as in launch/head.sh. With token
# authentication (the default) this node needs the head's token: RAY_AUTH_TOKEN=<token>, or the head's
# ~/.ray/auth_token copied here, or RAY_AUTH_TOKEN_PATH pointing at a copy.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: launch/worker.sh HEAD_IP:PORT [extra ray start arguments]" >&2
    exit 2
fi
head_address="$1"
shift

# shellcheck source=launch/head.sh
source "$(dirname "${BASH_SOURCE[0]}")/head.sh"
sparkrl_env

if [[ "$RAY_AUTH_MODE" == "token" && -z "${RAY_AUTH_TOKEN:-}" && -z "${RAY_AUTH_TOKEN_PATH:-}" \
      && ! -s "$HOME/.ray/auth_token" ]]; then
    echo "launch: token authentication is on but this node has no token: set RAY_AUTH_TOKEN to the" \
         "head's (ray get-auth-token, on the head)" >&2
    exit 2
fi

args=(start --address="$head_address" --disable-usage-stats)
[[ -n "${NODE_IP:-}" ]] && args+=(--node-ip-address="$NODE_IP")
[[ -n "${NUM_GPUS:-}" ]] && args+=(--num-gpus="$NUM_GPUS")
[[ "${BLOCK:-0}" == "1" ]] && args+=(--block)

ray "${args[@]}" "$@"
