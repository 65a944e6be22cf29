#!/bin/sh
# The CPU runs of `radixd bench` recorded in BENCHMARKS.md ("radixd bench (CPU)"):
# a radixd daemon on the default model, the in-process engine and the transformers peer on the
# same prompts, and the engine-vs-hf greedy check. Results: benchmarks/results/radixd_bench_cpu/.
#
#   sh benchmarks/radixd_bench_cpu.sh                 # everything, about 25 minutes on 2 cores
#   sh benchmarks/radixd_bench_cpu.sh sweep chat      # some parts: sweep chat repeats check
#   REPS=3 sh benchmarks/radixd_bench_cpu.sh repeats  # one more round of the repeats
#
# `repeats` runs radixd (HTTP), engine and hf back to back, per workload, for each round in
# $REPS (default: 1 2), so that each comparison is made within one stretch of time on a
# machine that may be shared.
set -eu
cd "$(dirname "$0")/.."
OUT=benchmarks/results/radixd_bench_cpu
mkdir -p "$OUT"
PARTS=${*:-sweep chat repeats check}
PORT=${PORT:-18555}
TMP=$(mktemp -d)
cat > "$TMP/radixd.toml" <<EOF
[server]
port = $PORT
[memory]
kv_cache_tokens = 32768
EOF
radixd --config "$TMP/radixd.toml" 2> "$TMP/daemon.log" &
DAEMON=$!
trap 'kill -TERM $DAEMON 2>/dev/null; wait $DAEMON 2>/dev/null || true' EXIT
for _ in $(seq 300); do grep -qs '"listening"' "$TMP/daemon.log" && break; sleep 1; done
URL=http://127.0.0.1:$PORT

SHARED="--workload shared-prefix --groups 8 --prompts-per-group 4 --system-len 512 --question-len 32 --output-len 32"
RANDOM_="--workload random --num-prompts 32 --input-len 256:512 --output-len 32:64"

for part in $PARTS; do
  case $part in
  sweep)  # radixd over HTTP (native route), swept over concurrency; the last = all at once
    radixd bench --url $URL $SHARED --sweep-concurrency 1,4,16,32 --name radixd-shared-prefix \
        --output $OUT/radixd_shared_prefix.json --plot-dir $OUT ;;
  chat)   # the OpenAI chat route (text prompts, the server applies the chat template)
    radixd bench --url $URL --api chat $SHARED --name radixd-chat-shared-prefix \
        --output $OUT/radixd_chat_shared_prefix.json --plot-dir $OUT ;;
  repeats)
    for rep in ${REPS:-1 2}; do
      for w in shared_prefix random; do
        if [ $w = shared_prefix ]; then W=$SHARED; else W=$RANDOM_; fi
        radixd bench --url $URL $W --name radixd-$w-$rep --output $OUT/radixd_${w}_$rep.json --plot-dir $OUT
        radixd bench --target engine --engine-arg kv_cache_tokens=32768 $W --name engine-$w-$rep --output $OUT/engine_${w}_$rep.json
        # the naive peer: transformers generate(), all 32 requests in one left-padded batch
        radixd bench --target hf --hf-batch-size 32 $W --name hf-$w-$rep --output $OUT/hf_${w}_$rep.json \
            --plot-dir $OUT
      done
    done
    for rep in ${REPS:-1 2}; do
      for w in shared_prefix random; do
        radixd bench compare $OUT/hf_${w}_$rep.json $OUT/radixd_${w}_$rep.json
        radixd bench compare $OUT/engine_${w}_$rep.json $OUT/radixd_${w}_$rep.json
      done
    done ;;
  check)
    radixd bench --check-greedy 8 --workload random --input-len 64:256 --output-len 32 \
        --output $OUT/check_greedy.json ;;
  *) echo "unknown part: $part" >&2; exit 2 ;;
  esac
done
