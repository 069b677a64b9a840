#!/usr/bin/env bash
# Prefill/decode smoke: a prefill `serve` and a decode `serve`,
# each a real vllm-rs frontend with a simulated engine behind it, and `vllm-vcr pd-proxy`
# in front. Sends completions through the proxy, checks the answers and the KV handoff,
# and prints the control-plane overhead per request (proxy vs. one engine alone).
#
#   scripts/pd_control.sh [N_REQUESTS]
#
# VCR_BIN picks the binary (default: target/debug/vllm-vcr, built if missing). Ports come
# from VCR_PD_BASE_PORT (default 18400: 18400-18404 are used), or VCR_PD_PORTS lists the
# five (prefill, decode, proxy, side channel, single engine). Exits non-zero on any
# failed check; everything it started is stopped on exit. With a binary built with
# `--features nixl` the KV bytes move over NIXL and are checked (VCR_EXPECT_NIXL=1 fails
# the run if they did not).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

N=${1:-20}
BIN=${VCR_BIN:-target/debug/vllm-vcr}
if [[ ! -x $BIN ]]; then
  cargo build --quiet
fi
# five ports: prefill, decode, proxy, side channel, single engine
if [[ -n ${VCR_PD_PORTS:-} ]]; then
  read -r PF DEC PROXY SIDE ONE <<<"$VCR_PD_PORTS"
else
  BASE=${VCR_PD_BASE_PORT:-18400}
  PF=$BASE DEC=$((BASE + 1)) PROXY=$((BASE + 2)) SIDE=$((BASE + 3)) ONE=$((BASE + 4))
fi
LOGS=$(mktemp -d)
PIDS=()
export NO_COLOR=1
cleanup() {
  for p in "${PIDS[@]}"; do kill -INT "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
# HTTP with python3's standard library (always there; curl may not be): prints the body,
# fails on a non-2xx answer. http URL [JSON_BODY]
http() {
  python3 - "$@" <<'PY'
import sys, urllib.request
url = sys.argv[1]
data = sys.argv[2].encode() if len(sys.argv) > 2 else None
req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=60) as r:
        sys.stdout.write(r.read().decode())
except Exception as e:
    sys.stderr.write(f"{url}: {e}\n")
    sys.exit(1)
PY
}
fail() {
  echo "pd_control: FAIL: $*" >&2
  # the logs go with the failure: a CI run keeps nothing else
  for f in "$LOGS"/*.log; do
    echo "--- last lines of $f" >&2
    tail -n 15 "$f" >&2
  done
  exit 1
}

NAMES=(prefill decode one proxy)
"$BIN" serve --port "$PF" --pd-role prefill --engine-id prefill-0 \
  --side-channel-port "$SIDE" --log-requests >"$LOGS/prefill.out" 2>"$LOGS/prefill.log" &
PIDS+=($!)
"$BIN" serve --port "$DEC" --pd-role decode --engine-id decode-0 \
  --log-requests >"$LOGS/decode.out" 2>"$LOGS/decode.log" &
PIDS+=($!)
"$BIN" serve --port "$ONE" >"$LOGS/one.out" 2>"$LOGS/one.log" &
PIDS+=($!)
"$BIN" pd-proxy --prefill "http://127.0.0.1:$PF" --decode "http://127.0.0.1:$DEC" \
  --port "$PROXY" >"$LOGS/proxy.out" 2>"$LOGS/proxy.log" &
PIDS+=($!)

# each process is up when its /health answers; one that exits is a failure at once
PORTS=("$PF" "$DEC" "$ONE" "$PROXY")
for i in 0 1 2 3; do
  port=${PORTS[$i]}
  for _ in $(seq 1 600); do
    http "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    kill -0 "${PIDS[$i]}" 2>/dev/null || fail "${NAMES[$i]} (port $port) exited before it served"
    sleep 0.2
  done
  http "http://127.0.0.1:$port/health" >/dev/null || fail "${NAMES[$i]} (port $port) never came up"
done

# one request through the pair: the whole answer, and the prompt's blocks moved
PROMPT="The control plane moves the KV of this prompt from prefill to decode."
BODY="{\"model\":\"tiny\",\"prompt\":\"$PROMPT\",\"max_tokens\":16}"
OUT=$(http "http://127.0.0.1:$PROXY/v1/completions" "$BODY") \
  || fail "the proxy did not answer"
echo "$OUT" | grep -q '"completion_tokens":16' || fail "not a whole answer: $OUT"
BLOCKS=$(((${#PROMPT} + 15) / 16))
# the prefill frees the blocks when the read is reported (with NIXL: its notification)
for _ in $(seq 1 50); do
  grep -q "KV read by the decode engine" "$LOGS/prefill.log" && break
  sleep 0.1
done
grep -q "KV read by the decode engine.*blocks=$BLOCKS" "$LOGS/prefill.log" \
  || fail "the prefill did not free $BLOCKS blocks after the read"
grep -q "remote KV pulled.*blocks=$BLOCKS" "$LOGS/decode.log" \
  || fail "the decode did not pull $BLOCKS blocks"
if grep -q "every byte verified" "$LOGS/decode.log"; then
  BYTES=$(grep -m1 "every byte verified" "$LOGS/decode.log" | sed -E 's/.* bytes=([0-9]+).*/\1/')
  echo "pd_control: NIXL data plane: $BYTES bytes read and verified"
elif [[ ${VCR_EXPECT_NIXL:-0} == 1 ]]; then
  fail "VCR_EXPECT_NIXL=1 but the decode moved no bytes over NIXL"
fi
USAGE=$(http "http://127.0.0.1:$PF/metrics" | awk '/^vllm:kv_cache_usage_perc/ {print $NF}')
[[ $USAGE == "0" || $USAGE == "0.0" ]] || fail "prefill KV still in use: $USAGE"
echo "pd_control: one request through the pair: 16 tokens, $BLOCKS blocks pulled and freed"

# overhead: N sequential requests through the pair against N to one engine (one client
# process, keep the timing to the requests themselves)
python3 - "$N" "$PROXY" "$ONE" "$PROMPT" <<'PY' || fail "the overhead run failed"
import json, sys, time, urllib.request
n, pair, one, prompt = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
def mean_us(port):
    t0 = time.perf_counter()
    for i in range(n):
        body = json.dumps({"model": "tiny", "prompt": f"request {i}: {prompt}", "max_tokens": 8}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.load(r)["usage"]["completion_tokens"] == 8
    return (time.perf_counter() - t0) / n * 1e6
one_engine = mean_us(one)
through_pair = mean_us(pair)
print(f"pd_control: {n} sequential requests: {through_pair:.0f} us each through proxy+prefill+decode, "
      f"{one_engine:.0f} us on one engine; handoff overhead {through_pair - one_engine:.0f} us per request")
PY
echo "pd_control: PASS"
