#!/bin/sh
# The CPU runs of `radixd bench` recorded in BENCHMARKS.md ("radixd bench (CPU)"):
# a radixd daemon on the default model, then the transformers peer and the in-process engine
# on the same prompts, and the engine-vs-hf greedy check. Results: bench/results/radixd_bench_cpu/.
#
#   sh bench/radixd_bench_cpu.sh            # about 15 minutes on 2 cores
set -eu
cd "$(dirname "$0")/.."
OUT=bench/results/radixd_bench_cpu
mkdir -p "$OUT"
PORT=${PORT:-18555}
TMP=$(mktemp -d)
CONF=$TMP/radixd.toml
cat > "$CONF" <<EOF
[server]
port = $PORT
[memory]
kv_cache_tokens = 32768
EOF
radixd --config "$CONF" 2> "$TMP/daemon.log" &
DAEMON=$!
trap 'kill -TERM $DAEMON 2>/dev/null; wait $DAEMON 2>/dev/null || true' EXIT
for _ in $(seq 300); do grep -q '"listening"' "$TMP/daemon.log" && break; sleep 1; done
URL=http://127.0.0.1:$PORT

SHARED="--workload shared-prefix --groups 8 --prompts-per-group 4 --system-len 512 --question-len 32 --output-len 32"
RANDOM_="--workload random --num-prompts 32 --input-len 256:512 --output-len 32:64"

# radixd over HTTP (native route): shared-prefix swept over concurrency, the last = all at once
radixd bench --url $URL $SHARED --sweep-concurrency 1,4,16,32 --name radixd-shared-prefix \
    --output $OUT/radixd_shared_prefix.json --plot-dir $OUT
# the same through the OpenAI chat route (text prompts, chat template applied by the server)
radixd bench --url $URL --api chat $SHARED --name radixd-chat-shared-prefix \
    --output $OUT/radixd_chat_shared_prefix.json --plot-dir $OUT
radixd bench --url $URL $RANDOM_ --name radixd-random --output $OUT/radixd_random.json --plot-dir $OUT
kill -TERM $DAEMON; wait $DAEMON || true
trap - EXIT

# the naive peer (transformers generate(), one batch of all 32 requests) and the engine, in-process
radixd bench --target hf --hf-batch-size 32 $SHARED --name hf-shared-prefix \
    --output $OUT/hf_shared_prefix.json --plot-dir $OUT
radixd bench --target hf --hf-batch-size 32 $RANDOM_ --name hf-random --output $OUT/hf_random.json --plot-dir $OUT
radixd bench --target engine $SHARED --name engine-shared-prefix \
    --output $OUT/engine_shared_prefix.json --plot-dir $OUT
radixd bench --check-greedy 8 --workload random --input-len 64:256 --output-len 32 \
    --output $OUT/check_greedy.json

for peer in hf engine; do
  radixd bench compare $OUT/${peer}_shared_prefix.json $OUT/radixd_shared_prefix.json
done
radixd bench compare $OUT/hf_random.json $OUT/radixd_random.json
