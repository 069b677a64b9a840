#!/bin/bash
# The vllm-vcr image's entrypoint: turns environment variables into the command line of
# one mode, prints that command, and execs it (so signals reach the process itself).
#
#   serve     (default) the vllm-rs frontend and `vllm-vcr play` in this container
#   play      the simulated engine alone, joining a frontend's handshake (a sidecar)
#   frontend  vllm-rs alone, in external-engine mode (a sidecar next to `play`, `record`
#             or a real engine)
#   record    the `vllm-vcr record` tap between a frontend and an engine (a sidecar)
#   env       print the variables this entrypoint reads and the flags they map to
#   anything else runs `vllm-vcr <args>` as given (`inspect …`, `pd-proxy …`, `--version`)
#
# Arguments after the mode are appended to the command (`play --log-requests`).
# A value that does not parse, or a MOCK_* variable this script does not know, stops the
# container with exit status 2 and a message naming the variable: a typo must not fall
# back to a default silently. docs/deploy.md has the same table with explanations.
set -euo pipefail

ME=vllm-vcr-entrypoint
TINY_MODEL=/opt/vllm-vcr/model

die() {
    echo "$ME: error: $*" >&2
    exit 2
}
note() { echo "$ME: $*" >&2; }

# NAME | kind | flag | scope (engine: serve+play; frontend: serve+frontend; record; any)
# kinds: int:MIN (whole number >= MIN), ms (milliseconds, >= 0), num (>= 0),
#        frac (0..1), bool, enum:a,b,c, file, files (space-separated), text, hex, json
TABLE=$(cat <<'EOF'
MOCK_MAX_NUM_SEQS|int:1|--max-num-seqs|engine
MOCK_MAX_NUM_BATCHED_TOKENS|int:1|--max-num-batched-tokens|engine
MOCK_MAX_MODEL_LEN|int:2|--max-model-len|engine
MOCK_MAX_LORAS|int:0|--max-loras|engine
MOCK_KV_CACHE_SIZE|int:1|--kv-cache-size|engine
MOCK_NUM_GPU_BLOCKS|int:2|--num-gpu-blocks|engine
MOCK_BLOCK_SIZE|int:1|--block-size|engine
MOCK_ENABLE_PREFIX_CACHING|bool|--enable-prefix-caching|engine
MOCK_ENABLE_CHUNKED_PREFILL|bool|--enable-chunked-prefill|engine
MOCK_SCHEDULING_POLICY|enum:fcfs,priority,shortest-prompt-first|--scheduling-policy|engine
MOCK_TTFT_MS|ms|--time-to-first-token|engine
MOCK_TTFT_STD_MS|ms|--time-to-first-token-std-dev|engine
MOCK_TTFT_MODE|enum:step,fixed|--ttft-mode|engine
MOCK_ITL_MS|ms|--inter-token-latency|engine
MOCK_ITL_STD_MS|ms|--inter-token-latency-std-dev|engine
MOCK_PREFILL_TIME_PER_TOKEN_MS|ms|--prefill-time-per-token|engine
MOCK_TIME_SCALE|num|--time-scale|engine
MOCK_TOKENS|enum:random,echo,text|--tokens|engine
MOCK_SEED|int:0|--seed|engine
MOCK_NUM_SPECULATIVE_TOKENS|int:0|--num-speculative-tokens|engine
MOCK_FAILURE_INJECTION_RATE|frac|--failure-injection-rate|engine
MOCK_PD_ROLE|enum:prefill,decode,both|--pd-role|engine
MOCK_ENGINE_ID|text|--engine-id|engine
MOCK_SIDE_CHANNEL_HOST|text|--side-channel-host|engine
MOCK_SIDE_CHANNEL_PORT|int:1|--side-channel-port|engine
MOCK_KV_TRANSFER_LATENCY_MS|ms|--kv-transfer-latency|engine
MOCK_KV_LOAD_FAILURE_POLICY|enum:fail,recompute|--kv-load-failure-policy|engine
MOCK_KV_EVENTS_CONFIG|json|--kv-events-config|engine
MOCK_LATENCY_TRACE|files|--latency-trace|engine
MOCK_LATENCY_STEPS|files|--latency-steps|engine
MOCK_REPLAY_TOKENS|file|--replay-tokens|engine
MOCK_REPLAY_STEPS|file|--replay-steps|engine
MOCK_REPLAY_MATCH|enum:index,prefix|--replay-match|engine
MOCK_REPLAY_MISS|enum:random,fail|--replay-miss|engine
MOCK_REPLAY_SUMMARY|text|--replay-summary|engine
MOCK_EXPECT_CONFIG_HASH|hex|--expect-config-hash|engine
MOCK_WAIT_FOR_TRACE_S|int:0|(entrypoint: wait this long for the trace files)|engine
MOCK_LOG_REQUESTS|bool|--log-requests|engine
MOCK_DISABLE_LOG_STATS|bool|--disable-log-stats|engine
MOCK_SHUTDOWN_TIMEOUT_S|num|--shutdown-timeout|engine
MOCK_VLLM_VERSION|text|--vllm-version|engine
EOF
)

# The variables below have no MOCK_ prefix: they are shared with the frontend, or named as
# vLLM's own deployments name them.
#   MODEL                  model directory (serve, play: --tokenizer) or id (frontend, record)
#   SERVED_MODEL_NAME      --served-model-name
#   PORT (8000), HOST (0.0.0.0)   the OpenAI server's address
#   HANDSHAKE_ADDRESS      tcp://HOST:PORT of the frontend's engine handshake (sidecar modes;
#                          default tcp://127.0.0.1:29550; serve picks a free port unless set)
#   ENGINE_HANDSHAKE_ADDRESS  record: where the engine connects (default tcp://127.0.0.1:29551)
#   TRACE_OUT, STEP_STATS_OUT, RECORD_TOKENS   record: --trace-out, --step-stats-out,
#                          --record-tokens
#   FRONTEND_ARGS          extra vllm-rs flags, split on spaces
#   FRONTEND_LOG           serve: where the frontend's output goes (default: this stderr)
#   VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT   vLLM's names, used when the MOCK_ ones are unset

is_bool() { [[ "${1,,}" =~ ^(1|0|true|false|yes|no|on|off)$ ]]; }
is_true() { [[ "${1,,}" =~ ^(1|true|yes|on)$ ]]; }

# check NAME VALUE KIND: exit with a message naming NAME when VALUE is not a KIND
check() {
    local name=$1 value=$2 kind=$3 flag=$4
    local what
    case $kind in
    int:*)
        local min=${kind#int:}
        if [[ ! "$value" =~ ^[0-9]{1,18}$ ]] || ((10#$value < min)); then
            die "$name=\"$value\": expected a whole number >= $min (maps to $flag)"
        fi
        ;;
    ms | num)
        [[ $kind == ms ]] && what="milliseconds" || what="a number"
        if [[ ! "$value" =~ ^([0-9]+([.][0-9]*)?|[.][0-9]+)$ ]]; then
            die "$name=\"$value\": expected $what >= 0, e.g. 25 or 2.5 (maps to $flag)"
        fi
        ;;
    frac)
        if [[ ! "$value" =~ ^(0|1|0?[.][0-9]+|1[.]0*)$ ]]; then
            die "$name=\"$value\": expected a fraction between 0 and 1, e.g. 0.05 (maps to $flag)"
        fi
        ;;
    bool)
        is_bool "$value" || die "$name=\"$value\": expected true or false (maps to $flag)"
        ;;
    enum:*)
        # exactly one of the choices: `prefill,decode` is not a role
        local choices=${kind#enum:} choice ok=
        local -a list
        IFS=, read -r -a list <<<"$choices"
        for choice in "${list[@]}"; do
            [[ "$value" == "$choice" ]] && ok=1
        done
        [[ -n $ok ]] ||
            die "$name=\"$value\": expected one of ${choices//,/, } (maps to $flag)"
        ;;
    hex)
        [[ "$value" =~ ^[0-9a-fA-F]+$ ]] || die "$name=\"$value\": expected a hex digest (maps to $flag)"
        ;;
    json)
        [[ "$value" =~ ^[[:space:]]*\{.*\}[[:space:]]*$ ]] ||
            die "$name: expected a JSON object such as {\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\"} (maps to $flag)"
        ;;
    text | file | files)
        [[ -n "${value// /}" ]] || die "$name is set but empty (maps to $flag)"
        ;;
    esac
}

# Kubernetes' service links put <SERVICE>_SERVICE_HOST, <SERVICE>_PORT… into every pod
# (a Service named `mock` gives MOCK_SERVICE_HOST and MOCK_PORT): those are not typos. A
# name is taken as one only when its service's <SERVICE>_SERVICE_HOST is there too, so
# that a typo such as MOCK_SIDE_CHANEL_PORT=5600 is not waved through as a link.
is_service_link() {
    local prefix="" rest=$1 host
    # every split NAME = <SERVICE>_<SUFFIX>: a service name may hold underscores, and so
    # may a suffix (MOCK_SERVICE_PORT is the SERVICE_PORT of `mock`)
    while [[ $rest == *_* ]]; do
        prefix+=${prefix:+_}${rest%%_*}
        rest=${rest#*_}
        [[ "$rest" =~ ^(SERVICE_HOST|SERVICE_PORT(_.*)?|PORT|PORT_[0-9]+_(TCP|UDP|SCTP)(_.*)?)$ ]] || continue
        host=${prefix}_SERVICE_HOST
        [[ -n "${!host+set}" ]] && return 0
    done
    return 1
}

known_names() { cut -d'|' -f1 <<<"$TABLE"; }

# Fail on MOCK_* variables that are not in the table.
check_unknown() {
    local name
    while IFS= read -r name; do
        [[ -z "$name" ]] && continue
        grep -qx "$name" < <(known_names) && continue
        is_service_link "$name" && continue
        local near
        near=$(known_names | grep -F -- "${name#MOCK_}" | tr '\n' ' ' || true)
        die "unknown variable $name${near:+ (did you mean: ${near% }?)}; run the image with the argument \`env\` to list the variables it reads"
    done < <(compgen -e | grep '^MOCK_' || true)
}

# Wait up to MOCK_WAIT_FOR_TRACE_S seconds for the trace files to appear (a trace copied
# into the pod's volume after start: `kubectl cp`), then require them.
wait_for_files() {
    local wait=${MOCK_WAIT_FOR_TRACE_S:-0} f deadline missing
    trap 'exit 143' TERM INT
    deadline=$((SECONDS + wait))
    while :; do
        missing=""
        for f in "$@"; do
            [[ -r "$f" ]] || missing+=" $f"
        done
        [[ -z "$missing" ]] && break
        if ((SECONDS >= deadline)); then
            if ((wait > 0)); then
                die "trace file(s) not there after ${wait} s:$missing"
            fi
            die "trace file(s) not found:$missing (mount them, or set MOCK_WAIT_FOR_TRACE_S to wait for a copy)"
        fi
        note "waiting for$missing (MOCK_WAIT_FOR_TRACE_S=$wait)"
        sleep 2
    done
    trap - TERM INT
}

# The engine flags from the MOCK_* variables, into the array ENGINE.
engine_flags() {
    ENGINE=()
    local files=()
    local name kind flag scope value
    if [[ -z "${MOCK_SIDE_CHANNEL_HOST:-}" && -n "${VLLM_NIXL_SIDE_CHANNEL_HOST:-}" ]]; then
        MOCK_SIDE_CHANNEL_HOST=$VLLM_NIXL_SIDE_CHANNEL_HOST
    fi
    if [[ -z "${MOCK_SIDE_CHANNEL_PORT:-}" && -n "${VLLM_NIXL_SIDE_CHANNEL_PORT:-}" ]]; then
        MOCK_SIDE_CHANNEL_PORT=$VLLM_NIXL_SIDE_CHANNEL_PORT
    fi
    if [[ -z "${MOCK_VLLM_VERSION:-}" && -n "${VLLM_VCR_IMAGE_VLLM_TAG:-}" ]]; then
        # the line of the vllm-rs in this image (read from its --version only from 0.29 on)
        MOCK_VLLM_VERSION=$VLLM_VCR_IMAGE_VLLM_TAG
    fi
    while IFS='|' read -r name kind flag scope; do
        [[ $scope == engine ]] || continue
        value=${!name-}
        [[ -z "${!name+set}" ]] && continue
        check "$name" "$value" "$kind" "$flag"
        case $kind in
        bool)
            case $flag in
            --enable-prefix-caching | --enable-chunked-prefill)
                if is_true "$value"; then ENGINE+=("$flag"); else ENGINE+=("--no-${flag#--}"); fi
                ;;
            *) is_true "$value" && ENGINE+=("$flag") ;;
            esac
            ;;
        files)
            local list
            read -r -a list <<<"$value"
            ENGINE+=("$flag" "${list[@]}")
            files+=("${list[@]}")
            ;;
        file)
            ENGINE+=("$flag" "$value")
            files+=("$value")
            ;;
        *)
            [[ $name == MOCK_WAIT_FOR_TRACE_S ]] && continue
            ENGINE+=("$flag" "$value")
            ;;
        esac
    done <<<"$TABLE"
    if ((${#files[@]})); then
        wait_for_files "${files[@]}"
    fi
}

# Warn about engine variables given to a mode without an engine (a shared ConfigMap).
warn_engine_vars() {
    local mode=$1 name set=()
    while IFS= read -r name; do
        [[ -n "${!name+set}" ]] && set+=("$name")
    done < <(known_names)
    if ((${#set[@]})); then
        note "note: ${set[*]}: engine settings, ignored in \`$mode\` mode (no engine runs here)"
    fi
}

# host and port of a tcp://HOST:PORT address, into ADDR_HOST / ADDR_PORT
split_address() {
    local name=$1 value=$2
    if [[ ! "$value" =~ ^tcp://(\[[0-9a-fA-F:]+\]|[^:/]+):([0-9]{1,5})$ ]]; then
        die "$name=\"$value\": expected tcp://HOST:PORT"
    fi
    ADDR_HOST=${BASH_REMATCH[1]}
    ADDR_PORT=${BASH_REMATCH[2]}
}

check_common() {
    if [[ -n "${PORT+set}" ]]; then
        check PORT "$PORT" int:1 --port
        # base 10 (a leading zero is not octal: PORT=08080 is 8080)
        ((10#$PORT <= 65535)) || die "PORT=\"$PORT\": expected a port number (1-65535)"
        PORT=$((10#$PORT))
    fi
    [[ -z "${RECORD_TOKENS+set}" ]] || check RECORD_TOKENS "$RECORD_TOKENS" bool --record-tokens
}

run() {
    note "exec $(printf '%q ' "$@")"
    exec "$@"
}

print_env() {
    echo "MOCK_* variables (the engine; serve and play modes):"
    while IFS='|' read -r name kind flag _; do
        printf '  %-32s %-44s %s\n' "$name" "${kind//,/|}" "$flag"
    done <<<"$TABLE"
    sed -n '/^# The variables below have no MOCK_ prefix/,/^$/p' "$0" | sed 's/^#/ /'
}

mode=${1:-serve}
[[ $# -gt 0 ]] && shift

case $mode in
serve)
    check_unknown
    check_common
    engine_flags
    cmd=(vllm-vcr serve --frontend-bin "$(command -v vllm-rs)"
        --host "${HOST:-0.0.0.0}" --port "${PORT:-8000}"
        --log-file "${FRONTEND_LOG:-/proc/self/fd/2}")
    if [[ -n "${MODEL:-}" ]]; then
        [[ -d "$MODEL" ]] || die "MODEL=\"$MODEL\": not a directory. serve needs a model directory (config.json and tokenizer.json, no weights): mount one there, or leave MODEL unset for the embedded tiny model"
        cmd+=(--model "$MODEL")
    fi
    [[ -n "${SERVED_MODEL_NAME:-}" ]] && cmd+=(--served-model-name "$SERVED_MODEL_NAME")
    if [[ -n "${HANDSHAKE_ADDRESS:-}" ]]; then
        split_address HANDSHAKE_ADDRESS "$HANDSHAKE_ADDRESS"
        cmd+=(--handshake-port "$ADDR_PORT")
    fi
    cmd+=("${ENGINE[@]}" "$@")
    if [[ -n "${FRONTEND_ARGS:-}" ]]; then
        read -r -a extra <<<"$FRONTEND_ARGS"
        cmd+=(-- "${extra[@]}")
    fi
    run "${cmd[@]}"
    ;;
play)
    check_unknown
    check_common
    engine_flags
    address=${HANDSHAKE_ADDRESS:-tcp://127.0.0.1:29550}
    split_address HANDSHAKE_ADDRESS "$address"
    cmd=(vllm-vcr play --handshake-address "$address")
    if [[ -n "${MODEL:-}" ]]; then
        if [[ -d "$MODEL" ]]; then
            cmd+=(--tokenizer "$MODEL")
        else
            note "MODEL=\"$MODEL\" is not a directory here: the engine emits token ids of the embedded tiny model's range (set MODEL to a mounted model directory to use its tokenizer)"
        fi
    fi
    run "${cmd[@]}" "${ENGINE[@]}" "$@"
    ;;
frontend)
    check_unknown
    check_common
    warn_engine_vars frontend
    address=${HANDSHAKE_ADDRESS:-tcp://127.0.0.1:29550}
    split_address HANDSHAKE_ADDRESS "$address"
    model=${MODEL:-$TINY_MODEL}
    name=${SERVED_MODEL_NAME:-}
    [[ -z "$name" && -z "${MODEL:-}" ]] && name=tiny
    cmd=(vllm-rs serve "$model" --data-parallel-size 1 --data-parallel-size-local 0
        --handshake-host "$ADDR_HOST" --handshake-port "$ADDR_PORT"
        --host "${HOST:-0.0.0.0}" --port "${PORT:-8000}" --reasoning-parser none)
    [[ -n "$name" ]] && cmd+=(--served-model-name "$name")
    if [[ -n "${FRONTEND_ARGS:-}" ]]; then
        read -r -a extra <<<"$FRONTEND_ARGS"
        cmd+=("${extra[@]}")
    fi
    run "${cmd[@]}" "$@"
    ;;
record)
    check_unknown
    check_common
    warn_engine_vars record
    split_address HANDSHAKE_ADDRESS "${HANDSHAKE_ADDRESS:-tcp://127.0.0.1:29550}"
    split_address ENGINE_HANDSHAKE_ADDRESS "${ENGINE_HANDSHAKE_ADDRESS:-tcp://127.0.0.1:29551}"
    cmd=(vllm-vcr record --frontend-handshake "${HANDSHAKE_ADDRESS:-tcp://127.0.0.1:29550}"
        --engine-handshake "${ENGINE_HANDSHAKE_ADDRESS:-tcp://127.0.0.1:29551}"
        --trace-out "${TRACE_OUT:-/trace/trace.jsonl}")
    [[ -n "${STEP_STATS_OUT:-}" ]] && cmd+=(--step-stats-out "$STEP_STATS_OUT")
    is_true "${RECORD_TOKENS:-false}" && cmd+=(--record-tokens)
    # the trace's model name: the one clients send (SERVED_MODEL_NAME), else MODEL
    name=${SERVED_MODEL_NAME:-${MODEL:-}}
    [[ -n "$name" ]] && cmd+=(--model "$name")
    run "${cmd[@]}" "$@"
    ;;
env)
    print_env
    ;;
*)
    run vllm-vcr "$mode" "$@"
    ;;
esac
