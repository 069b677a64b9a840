#!/usr/bin/env bash
# Soak: `vllm-vcr serve` (the real vllm-rs frontend with the engine behind it) under
# `vllm-rs bench serve` load for a long time, measured window by window.
#
#   scripts/soak.sh [MINUTES] [WINDOW_MINUTES]      (default 60 and 5)
#
# Each window is one `bench serve` run at a fixed request rate (random dataset, 256 prompt
# tokens, 128 output tokens, ignore_eos). After each window the script samples the resident
# memory and CPU time of the engine (`serve`'s own process) and of the frontend, and prints
# one row: requests done and failed, TTFT p99, ITL p50/p99 (the engine paces tokens at
# --inter-token-latency, so ITL is its pacing), RSS and CPU. The table also goes to
# $SOAK_OUT/soak.md. Exit status 1 when any request failed or a window's bench run failed.
#
# Environment: VCR_BIN (default target/release/vllm-vcr), VLLM_RS (default: the cached
# 0.33.0 vllm-rs), SOAK_RATE requests/s (40), SOAK_CONCURRENCY (64), SOAK_ITL_MS (10),
# SOAK_TTFT_MS (50), SOAK_OUT (a new directory under /tmp).
set -euo pipefail

minutes=${1:-60}
window=${2:-5}
here=$(cd "$(dirname "$0")/.." && pwd)
bin=${VCR_BIN:-$here/target/release/vllm-vcr}
cache=${VLLM_VCR_CACHE:-$HOME/.cache/vllm-vcr}
rs=${VLLM_RS:-$cache/vllm-rs/0.33.0/vllm-rs}
rate=${SOAK_RATE:-40}
conc=${SOAK_CONCURRENCY:-64}
itl=${SOAK_ITL_MS:-10}
ttft=${SOAK_TTFT_MS:-50}
out=${SOAK_OUT:-$(mktemp -d /tmp/vllm-vcr-soak.XXXXXX)}
mkdir -p "$out"
[[ -x $bin ]] || { echo "soak: no binary at $bin (cargo build --release)" >&2; exit 2; }
[[ -x $rs ]] || { echo "soak: no vllm-rs at $rs (cargo xtask fetch)" >&2; exit 2; }

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
NO_COLOR=1 "$bin" serve --port "$port" --max-num-seqs "$conc" \
    --time-to-first-token "$ttft" --inter-token-latency "$itl" \
    --log-file "$out/frontend.log" >"$out/serve.out" 2>"$out/serve.err" &
serve_pid=$!
trap 'kill -INT $serve_pid 2>/dev/null; wait $serve_pid 2>/dev/null || true' EXIT

for _ in $(seq 1 600); do
    grep -q "pid" "$out/serve.out" 2>/dev/null && curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 $serve_pid 2>/dev/null || { echo "soak: serve exited:" >&2; tail -20 "$out/serve.err" >&2; exit 1; }
    sleep 0.1
done
front_pid=$(grep -o 'pid [0-9]*' "$out/serve.out" | head -1 | awk '{print $2}')
model=$(curl -s "http://127.0.0.1:$port/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["root"])')
echo "soak: serve pid $serve_pid, frontend pid $front_pid, port $port, ${minutes} min in ${window}-min windows at $rate req/s; logs in $out" >&2

# RSS (MiB) and CPU seconds of a pid
rss() { awk '/^VmRSS/ {printf "%.1f", $2/1024}' "/proc/$1/status"; }
cpu() { awk -v hz="$(getconf CLK_TCK)" '{printf "%.1f", ($14+$15)/hz}' "/proc/$1/stat"; }

table="$out/soak.md"
{
    echo "| window | minute | requests | failed | TTFT p99 ms | ITL p50 ms | ITL p99 ms | engine RSS MiB | frontend RSS MiB | engine CPU s | frontend CPU s |"
    echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
} | tee "$table"

windows=$(( (minutes + window - 1) / window ))
prompts=$(( rate * window * 60 ))
failed_total=0
start=$(date +%s)
for w in $(seq 1 "$windows"); do
    res="$out/window-$w"
    mkdir -p "$res"
    if ! NO_COLOR=1 "$rs" bench serve --port "$port" --model tiny --tokenizer "$model" \
        --dataset-name random --random-input-len 256 --random-output-len 128 \
        --num-prompts "$prompts" --request-rate "$rate" --max-concurrency "$conc" \
        --prompt-token-ids --ignore-eos --disable-tqdm --seed "$w" \
        --save-result --result-dir "$res" >"$res/bench.txt" 2>"$res/bench.err"; then
        echo "soak: window $w: bench serve failed" >&2
        tail -5 "$res/bench.err" >&2
        failed_total=$((failed_total + 1))
        continue
    fi
    row=$(python3 - "$res" <<'EOF'
import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
r = json.loads(next(p for p in d.iterdir() if p.suffix == ".json").read_text())
def g(*keys):
    for k in keys:
        if k in r and r[k] is not None:
            return r[k]
    return float("nan")
done = int(g("completed", "successful_requests"))
failed = int(g("failed", "failed_requests")) if ("failed" in r or "failed_requests" in r) else 0
print(done, failed, "%.1f" % g("p99_ttft_ms"), "%.2f" % g("median_itl_ms", "p50_itl_ms"), "%.2f" % g("p99_itl_ms"))
EOF
)
    read -r done failed ttft99 itl50 itl99 <<<"$row"
    failed_total=$((failed_total + failed))
    minute=$(( ($(date +%s) - start) / 60 ))
    echo "| $w | $minute | $done | $failed | $ttft99 | $itl50 | $itl99 | $(rss $serve_pid) | $(rss $front_pid) | $(cpu $serve_pid) | $(cpu $front_pid) |" | tee -a "$table"
done

errors=$(grep -c -E " ERROR | WARN " "$out/serve.err" || true)
echo "soak: $failed_total failed request(s) or windows; $errors ERROR/WARN line(s) in the engine's log ($out/serve.err)" | tee -a "$table" >&2
[[ $failed_total -eq 0 ]]
