#!/usr/bin/env bash
# Benchmarks behind the numbers in the issues' closing notes. Not a test:
# it prints measurements. Needs a release build (cargo build --release
# --bins --examples), redis-server and redis-benchmark.
#
#   benches/bench.sh memory     in-memory engine vs a constant-OK tonic server
#   benches/bench.sh redis      the gRPC ceiling, memory, the Redis path (hot
#                               key, 10,000 keys, a key over its limit,
#                               200,000 keys then idle CPU, four
#                               replicas in aggregate), Redis CPU and
#                               commands per 1000 decisions, EVALSHA alone,
#                               bytes per key
#   benches/bench.sh outage     Redis up / down (local path) / recovery,
#                               local path vs memory (median of 3), RSS with
#                               100,000 keys through an outage
#   benches/bench.sh cluster    the Redis path on one Redis and on a
#                               3-master Redis Cluster in the same run (a
#                               hot key, 10,000 keys), Redis CPU and
#                               commands per 1000 decisions per node
#   benches/bench.sh soak       bounded memory with default settings: peak
#                               RSS after 1,000,000 distinct 1 KiB values on
#                               a day rule (in memory), and after 100,000
#                               keys through a Redis outage
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/leasehold}
DUR=${DUR:-10}
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

cat > "$WORK/rules.yaml" <<'YAML'
domain: bench
descriptors:
  - key: key
    rate_limit:
      unit: second
      requests_per_unit: 1000000000
  - key: over
    rate_limit:
      unit: minute
      requests_per_unit: 1
  - key: day
    rate_limit:
      unit: day
      requests_per_unit: 1000
YAML

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }

start_redis() {
  REDIS_PORT=${REDIS_PORT:-$(free_port)}
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$WORK" >"$WORK/redis.log" 2>&1 &
  REDIS_PID=$!; PIDS+=("$REDIS_PID")
  until redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1; do sleep 0.05; done
}

# start_leasehold NAME [extra args...]: sets GRPC_<NAME>, HTTP_<NAME>,
# ADMIN_<NAME> (/status), PID_<NAME>
start_leasehold() {
  local name=$1; shift
  local g h a; g=$(free_port); h=$(free_port); a=$(free_port)
  # The kernel may hand out a port just freed again: three distinct ones.
  while [ "$h" = "$g" ]; do h=$(free_port); done
  while [ "$a" = "$g" ] || [ "$a" = "$h" ]; do a=$(free_port); done
  "$BIN" serve --rules "$WORK/rules.yaml" --grpc-addr "127.0.0.1:$g" --http-addr "127.0.0.1:$h" --admin-addr "127.0.0.1:$a" --log-level warn "$@" >"$WORK/$name.log" 2>&1 &
  local pid=$!; PIDS+=("$pid")
  until curl -sf "127.0.0.1:$h/readyz" >/dev/null 2>&1; do
    # A server that exited will never be ready: say why instead of waiting.
    if ! kill -0 "$pid" 2>/dev/null; then echo "leasehold $name exited: $(cat "$WORK/$name.log")" >&2; exit 1; fi
    sleep 0.05
  done
  eval "GRPC_$name=$g HTTP_$name=$h ADMIN_$name=$a PID_$name=$pid"
}

bench() { # ADDR KEYS [DESCRIPTOR KEY] -> prints one JSON line
  "$BIN" bench --addr "127.0.0.1:$1" --domain bench --key "${3:-key}" --keys "$2" --concurrency 64 --connections 4 --duration "$DUR" --json
}

# Redis commands run so far (INFO commandstats, every command).
redis_calls() { redis-cli -p "$REDIS_PORT" info commandstats | awk -F'[=,]' '/^cmdstat_/ {s+=$2} END {print s+0}'; }
redis_cpu() { redis-cli -p "$REDIS_PORT" info cpu | awk -F: '/used_cpu_(sys|user):/ {s+=$2} END {print s}'; }

# CPU seconds a process has used (user + system), from /proc.
cpu_of() { awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$1/stat"; }

# row LABEL PID ADDR KEYS [DESCRIPTOR KEY] [redis]: one run, with the
# server's CPU per decision and the ratio of its requests/s to the last
# ceiling row's (CEILING_RPS, when set; a row labelled "ceiling" sets it). On a
# machine whose speed drifts between runs, the CPU per decision is the
# steadier figure. With "redis", Redis CPU and commands per 1000
# decisions too. A ceiling row that follows another row also prints that
# row's ratios to the mean of the two ceilings around it (requests/s, p99,
# p99.9): this machine's speed drifts within a run, and a row measured
# between two ceilings is compared with the ceiling of its own minutes.
# That line ends with the row's verdict against its targets (the in-memory
# engine's p99 at most 0.6 x; on Redis at least 0.6 x the requests/s, p99
# at most 3 x, p99.9 at most 5 x and 8 ms of Redis CPU per 1000 decisions;
# the over-limit key at least 0.9 x), judged on unrounded figures.
row() {
  local label=$1 pid=$2 addr=$3 keys=$4 key=${5:-key} redis=${6:-}
  local c0 c1 r0 r1 k0 k1 r
  c0=$(cpu_of "$pid")
  if [ -n "$redis" ]; then r0=$(redis_cpu); k0=$(redis_calls); fi
  r=$(bench "$addr" "$keys" "$key")
  c1=$(cpu_of "$pid")
  if [ -n "$redis" ]; then r1=$(redis_cpu); k1=$(redis_calls); else r1=0; r0=0; k1=0; k0=0; fi
  case $label in
    *ceiling*)
      if [ -n "${CEILING_JSON:-}" ] && [ -n "${LAST_JSON:-}" ]; then
        python3 -c '
import json, sys
a, b, row = (json.loads(x) for x in sys.argv[1:4])
label, redis_ms = sys.argv[4], sys.argv[5]
m = lambda k: (a[k] + b[k]) / 2
rps = row["requests_per_second"] / m("requests_per_second")
p99 = row["p99_us"] / m("p99_us")
p999 = row["p999_us"] / m("p999_us")
missed = []
if "over-limit" in label:
    missed += ["req/s %.3f x < 0.9" % rps] if rps < 0.9 else []
elif "memory" in label:
    missed += ["p99 %.3f x > 0.6" % p99] if p99 > 0.6 else []
elif "redis" in label:
    missed += ["req/s %.3f x < 0.6" % rps] if rps < 0.6 else []
    missed += ["p99 %.3f x > 3" % p99] if p99 > 3 else []
    missed += ["p99.9 %.3f x > 5" % p999] if p999 > 5 else []
    if redis_ms and float(redis_ms) > 8:
        missed.append("Redis CPU %.2f ms > 8 per 1000 decisions" % float(redis_ms))
known = any(t in label for t in ("over-limit", "memory", "redis"))
verdict = "targets missed: " + ", ".join(missed) if missed else "targets met" if known else "no targets"
print("  %s %.2f x the ceilings around it in req/s, p99 %.2f x, p99.9 %.2f x; %s" % (
    label, rps, p99, p999, verdict))' "$CEILING_JSON" "$r" "$LAST_JSON" "$LAST_LABEL" "${LAST_REDIS_MS:-}"
      fi
      CEILING_JSON=$r; LAST_JSON=
      CEILING_RPS=$(echo "$r" | python3 -c 'import json,sys; print(json.load(sys.stdin)["requests_per_second"])');;
    *)
      LAST_JSON=$r; LAST_LABEL=$label; LAST_REDIS_MS=
      if [ -n "$redis" ]; then
        LAST_REDIS_MS=$(echo "$r" | python3 -c 'import json,sys; n = max(json.load(sys.stdin)["requests"], 1); print((float(sys.argv[2]) - float(sys.argv[1])) * 1e6 / n)' "$r0" "$r1")
      fi;;
  esac
  echo "$r" | python3 -c '
import json, sys
label, c0, c1, ceiling, redis, r0, r1, k0, k1 = sys.argv[1:]
r = json.load(sys.stdin); n = max(r["requests"], 1)
ratio = " (%.2f x ceiling)" % (r["requests_per_second"] / float(ceiling)) if ceiling else ""
line = "%-34s %6.0f req/s%s  p50 %.2f  p99 %.2f  p99.9 %.2f ms  errors %d  server CPU %.1f us/decision" % (
    label, r["requests_per_second"], ratio, r["p50_us"] / 1e3,
    r["p99_us"] / 1e3, r["p999_us"] / 1e3, r["errors"], (float(c1) - float(c0)) * 1e6 / n)
if redis:
    line += "  Redis CPU %.1f ms, %.0f commands per 1000 decisions" % (
        (float(r1) - float(r0)) * 1e6 / n, (float(k1) - float(k0)) * 1000 / n)
print(line)' "$label" "$c0" "$c1" "${CEILING_RPS:-}" "$redis" "$r0" "$r1" "$k0" "$k1"
}

summary() { python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print("%.0f req/s  p50 %.2f ms  p99 %.2f ms  p99.9 %.2f ms  errors %d" % (r["requests_per_second"], r["p50_us"]/1e3, r["p99_us"]/1e3, r["p999_us"]/1e3, r["errors"]))'; }

case "${1:-}" in
memory)
  start_leasehold mem
  CO_PORT=$(free_port); target/release/examples/constant_ok "127.0.0.1:$CO_PORT" & PIDS+=($!); sleep 0.5
  for keys in 1 10000; do
    echo "keys=$keys constant-OK: $(bench "$CO_PORT" $keys | summary)"
    echo "keys=$keys memory:      $(bench "$GRPC_mem" $keys | summary)"
  done
  ;;
redis)
  start_redis
  start_leasehold mem
  # A generous deadline: this measures the Redis path, not the fallback.
  LEASEHOLD_REDIS_DEADLINE_MS=${DEADLINE_MS:-100} start_leasehold red --redis-url "redis://127.0.0.1:$REDIS_PORT" --replica-id bench-1
  CO_PORT=$(free_port); target/release/examples/constant_ok "127.0.0.1:$CO_PORT" & CO_PID=$!; PIDS+=("$CO_PID"); sleep 0.5
  # Each measured row between two ceiling rows (see row()).
  for keys in 1 10000; do
    row "keys=$keys ceiling (constant-OK):" "$CO_PID" "$CO_PORT" $keys
    row "keys=$keys memory:" "$PID_mem" "$GRPC_mem" $keys
    row "keys=$keys ceiling (constant-OK):" "$CO_PID" "$CO_PORT" $keys
    row "keys=$keys redis:" "$PID_red" "$GRPC_red" $keys key redis
    row "keys=$keys ceiling (constant-OK):" "$CO_PID" "$CO_PORT" $keys
    # One hot key over its limit (1 per minute): denied from the over-limit
    # cache after Redis's first denial, refreshed every over_limit_cache_ms.
    if [ "$keys" = 1 ]; then
      row "over-limit hot key, redis:" "$PID_red" "$GRPC_red" 1 over redis
      row "keys=$keys ceiling (constant-OK):" "$CO_PID" "$CO_PORT" $keys
    fi
    CEILING_JSON=
  done
  # 200,000 keys (the default ledger_max_keys) on a day rule, so that none
  # is swept, then the replica left idle: its background rounds must not
  # scan every key each tick (they did, at 17% of a core when idle).
  row "keys=200000 (day rule) redis:" "$PID_red" "$GRPC_red" 200000 day redis
  c0=$(cpu_of "$PID_red"); sleep 3; c1=$(cpu_of "$PID_red")
  python3 -c 'import sys; print("idle replica after 200,000 keys: %.1f%% of a core" % ((float(sys.argv[2]) - float(sys.argv[1])) / 3 * 100))' "$c0" "$c1"
  # Four replicas on the one Redis, one hot key, 16 in flight to each (64
  # in all): requests/s summed, the worst replica's percentiles.
  for i in 2 3 4; do
    LEASEHOLD_REDIS_DEADLINE_MS=${DEADLINE_MS:-100} start_leasehold "red$i" --redis-url "redis://127.0.0.1:$REDIS_PORT" --replica-id "bench-$i"
  done
  before=$(redis_cpu); calls=$(redis_calls); loads=()
  for port in "$GRPC_red" "$GRPC_red2" "$GRPC_red3" "$GRPC_red4"; do
    "$BIN" bench --addr "127.0.0.1:$port" --domain bench --key key --keys 1 --concurrency 16 --connections 1 --duration "$DUR" --json >"$WORK/agg-$port.json" &
    loads+=($!)
  done
  wait "${loads[@]}"
  after=$(redis_cpu); after_calls=$(redis_calls)
  python3 - "$before" "$after" "$calls" "$after_calls" "$WORK"/agg-*.json <<'PY'
import json, sys
before, after, calls, after_calls = map(float, sys.argv[1:5])
runs = [json.load(open(f)) for f in sys.argv[5:]]
n = sum(r["requests"] for r in runs)
rps = sum(r["requests_per_second"] for r in runs)
worst = lambda k: max(r[k] for r in runs) / 1e3
# Denied on a limit of 10^9 per second: only a call past its budget
# (`path="unanswered"`), so a CPU-starved replica shows here.
print("four replicas, one hot key, in aggregate: %.0f req/s  p50 %.2f ms  p99 %.2f ms  p99.9 %.2f ms  errors %d  denied %d  Redis CPU %.1f ms, %.0f commands per 1000 decisions"
      % (rps, worst("p50_us"), worst("p99_us"), worst("p999_us"), sum(r["errors"] for r in runs),
         sum(r["over_limit"] for r in runs), (after - before) * 1e6 / n, (after_calls - calls) * 1000 / n))
PY
  curl -s "127.0.0.1:$ADMIN_red/status" | python3 -c 'import json,sys; d=json.load(sys.stdin)["engine"]["decisions"]; print("decisions by path:", d)'
  SHA=$(redis-cli -p "$REDIS_PORT" script load "$(cat src/redis/decide.lua)")
  # ARGV as src/redis/scripts.rs packs them: index, epoch, margin, episode,
  # peers, silent, the number of requests, then per request its shape, its
  # call id when the shape's flags say so (bit 1; a sliding-log charge
  # needs one) and two per charge, then the call's token.
  echo "redis-benchmark EVALSHA (same script, one request per call, one hot key, 64 clients, pipeline 1):"
  redis-benchmark -p "$REDIS_PORT" -c 64 -n 400000 -q EVALSHA "$SHA" 1 'lh:v2{bench|key=rb#1:fw}' 9 1 10000 '' '' '' 1 1,1,0 1,1000000000,1000,1000000000,1,0,0,0,0 -1 1 | tr '\r' '\n' | tail -1
  echo "Redis bytes per active key, four replicas writing (MEMORY USAGE):"
  for algo in "1 fw" "2 sw" "3 sl" "4 tb"; do
    set -- $algo
    key="lh:v2{mem|key=k#60:$2}"
    for idx in 1 2 3 4; do
      for i in $(seq 1 25); do
        redis-cli -p "$REDIS_PORT" evalsha "$SHA" 1 "$key" "$idx" 0 10000 '' '' '' 1 1,1,2 "m$idx.$i" "$1,100,60000,100,1,0,0,0,0" -1 1 >/dev/null
      done
    done
    for k in $(redis-cli -p "$REDIS_PORT" --scan --pattern "lh:v2{mem|key=k#60:$2}*"); do
      echo "  $2 $k: $(redis-cli -p "$REDIS_PORT" memory usage "$k" samples 0) bytes"
    done
  done
  ;;
outage)
  start_redis
  start_leasehold mem
  echo "idle replica VmRSS: $(awk '/VmRSS/ {print $2, $3}' /proc/$PID_mem/status)"
  # DEADLINE_MS: the Redis deadline, the default (5 ms) unless set. The
  # "decisions so far" line tells how many of the first row's decisions
  # Redis made within it and how many fell to the lease (with batching,
  # none did in the last runs on two cores).
  LEASEHOLD_REDIS_DEADLINE_MS=${DEADLINE_MS:-5} start_leasehold red --redis-url "redis://127.0.0.1:$REDIS_PORT" --replica-id bench-1
  echo "Redis up:      $(bench "$GRPC_red" 10000 | summary)"
  curl -s "127.0.0.1:$ADMIN_red/status" | python3 -c 'import json,sys; e=json.load(sys.stdin)["engine"]; print("  decisions so far:", e["decisions"])'
  kill -9 "$REDIS_PID"; sleep 0.5
  echo "Redis down:    $(bench "$GRPC_red" 10000 | summary)"
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$WORK" >>"$WORK/redis.log" 2>&1 & PIDS+=($!)
  until redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1; do sleep 0.05; done
  echo "Recovery:      $(bench "$GRPC_red" 10000 | summary)"
  curl -s "127.0.0.1:$ADMIN_red/status" | python3 -c 'import json,sys; e=json.load(sys.stdin)["engine"]; print("breaker:", e["breaker"]["state"], "decisions:", e["decisions"], "replay:", e["replay"])'
  REDIS_PID=$(pgrep -f "redis-server 127.0.0.1:$REDIS_PORT" | head -1)
  kill -9 "$REDIS_PID"; sleep 0.5
  for i in 1 2 3; do
    echo "run $i local path: $(bench "$GRPC_red" 1 | summary)"
    echo "run $i memory:     $(bench "$GRPC_mem" 1 | summary)"
  done
  echo "RSS through an outage with 100,000 keys:"
  "$BIN" bench --addr "127.0.0.1:$GRPC_red" --domain bench --key key --keys 100000 --concurrency 64 --connections 4 --duration 15 --json >/dev/null
  echo "  replica VmRSS: $(awk '/VmRSS/ {print $2, $3}' /proc/$PID_red/status)"
  curl -s "127.0.0.1:$ADMIN_red/status" | python3 -c 'import json,sys; e=json.load(sys.stdin)["engine"]; print("  ledger:", e["ledger"])'
  ;;
soak)
  hwm() { awk '/VmHWM/ {print $2, $3}' "/proc/$1/status"; }
  start_leasehold mem
  echo "idle replica VmRSS: $(awk '/VmRSS/ {print $2, $3}' /proc/$PID_mem/status)"
  echo "1,000,000 distinct 1 KiB values, day rule, memory engine (defaults):"
  "$BIN" bench --addr "127.0.0.1:$GRPC_mem" --domain bench --key day --unique --value-bytes 1024 --requests 1000000 --duration 600 --concurrency 64 --connections 4 --json
  echo "  peak VmRSS (VmHWM): $(hwm "$PID_mem")"
  curl -s "127.0.0.1:$ADMIN_mem/status" | python3 -c 'import json,sys; e=json.load(sys.stdin)["engine"]; print("  engine:", e)'
  start_redis
  start_leasehold red --redis-url "redis://127.0.0.1:$REDIS_PORT" --replica-id soak-1
  kill -9 "$REDIS_PID"; sleep 1
  echo "100,000 keys through a Redis outage (defaults):"
  "$BIN" bench --addr "127.0.0.1:$GRPC_red" --domain bench --key day --keys 100000 --duration 20 --concurrency 64 --connections 4 --json
  echo "  peak VmRSS (VmHWM): $(hwm "$PID_red")"
  curl -s "127.0.0.1:$ADMIN_red/status" | python3 -c 'import json,sys; e=json.load(sys.stdin)["engine"]; print("  ledger:", e["ledger"])'
  ;;
cluster)
  start_redis
  # Three masters (no replicas), bus ports at +10000.
  CLUSTER_PORTS=()
  while [ ${#CLUSTER_PORTS[@]} -lt 3 ]; do
    p=$(free_port)
    if [ "$p" -lt 55536 ] && python3 -c "import socket,sys; s=socket.socket(); s.bind(('127.0.0.1', $p + 10000))" 2>/dev/null; then CLUSTER_PORTS+=("$p"); fi
  done
  for p in "${CLUSTER_PORTS[@]}"; do
    mkdir -p "$WORK/c$p"
    redis-server --port "$p" --bind 127.0.0.1 --save '' --appendonly no --dir "$WORK/c$p" --cluster-enabled yes --cluster-config-file "nodes-$p.conf" >"$WORK/c$p.log" 2>&1 &
    PIDS+=($!)
    until redis-cli -p "$p" ping >/dev/null 2>&1; do sleep 0.05; done
  done
  redis-cli --cluster create $(printf '127.0.0.1:%s ' "${CLUSTER_PORTS[@]}") --cluster-yes >/dev/null
  until redis-cli -p "${CLUSTER_PORTS[0]}" cluster info | grep -q cluster_state:ok; do sleep 0.1; done
  URL="redis-cluster://127.0.0.1:${CLUSTER_PORTS[0]}?node=127.0.0.1:${CLUSTER_PORTS[1]}&node=127.0.0.1:${CLUSTER_PORTS[2]}"
  LEASEHOLD_REDIS_DEADLINE_MS=${DEADLINE_MS:-100} start_leasehold one --redis-url "redis://127.0.0.1:$REDIS_PORT" --replica-id bench-one
  LEASEHOLD_REDIS_DEADLINE_MS=${DEADLINE_MS:-100} start_leasehold clu --redis-url "$URL" --replica-id bench-clu
  node_stats() { # PORT -> "cpu_seconds commands"
    echo "$(redis-cli -p "$1" info cpu | awk -F: '/used_cpu_(sys|user):/ {s+=$2} END {print s}') $(redis-cli -p "$1" info commandstats | awk -F'[=,]' '/^cmdstat_/ {s+=$2} END {print s+0}')"
  }
  for run in "1 hot key:1" "10,000 keys:10000"; do
    label=${run%%:*}; keys=${run##*:}
    row "$label, one Redis:" "$PID_one" "$GRPC_one" "$keys" key redis
    declare -A before=()
    for p in "${CLUSTER_PORTS[@]}"; do before[$p]=$(node_stats "$p"); done
    r=$(bench "$GRPC_clu" "$keys")
    n=$(echo "$r" | python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["requests"])')
    echo "$label, 3-master cluster: $(echo "$r" | summary)"
    for p in "${CLUSTER_PORTS[@]}"; do
      after=$(node_stats "$p")
      python3 -c "
b = '${before[$p]}'.split(); a = '$after'.split(); n = $n
print('  node $p: CPU %.1f ms, %.0f commands per 1000 decisions' % ((float(a[0]) - float(b[0])) * 1e6 / n, (float(a[1]) - float(b[1])) * 1000 / n))"
    done
  done
  curl -s "127.0.0.1:$ADMIN_clu/status" | python3 -c 'import json,sys; e=json.load(sys.stdin)["engine"]; print("cluster replica decisions:", e["decisions"]); print("topology:", e["redis"]["topology"])'
  ;;
*)
  echo "usage: $0 memory|redis|outage|cluster|soak" >&2; exit 2;;
esac
