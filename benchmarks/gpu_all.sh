#!/bin/sh
# Every GPU check and figure of BENCHMARKS.md in one run, on a machine with CUDA GPUs (two
# for the multi-GPU parts), results under OUT and packed into OUT/results.tgz:
#
#   [WHEELS=DIR] sh benchmarks/gpu_all.sh OUT [PART...]
#
# WHEELS=DIR first installs the wheels in DIR (packages the machine lacks: pytest-asyncio,
# starlette, lark, ...; `sh benchmarks/wheels.sh DIR` downloads them) into a private
# directory on PYTHONPATH, for every part.
#
# PART (default: all but peer, which is slow):
#   tests     the GPU-marked tests (Triton kernels at real shapes, fused decode vs unfused and
#             vs the torch backend, the peer-to-peer all-reduce)
#   gpu       benchmarks/gpu_bench.py: ceilings, correctness, one-row fusions, the few-row GEMM
#             kernel on/off at batch 16 and 64, decode at batch 1, 64
#   full      benchmarks/gpu_bench.py, every section, with the transformers peer (PEER=path to
#             hf_baseline.py)
#   profile   benchmarks/decode_profile.py: the batch-1 step's device time and kernel families,
#             the one-row fusions per shape (PROFILE=sections to choose others)
#   tp dp     benchmarks/multi_gpu_bench.py's sections (two GPUs); MULTI_ARGS adds options (e.g.
#             "--dp-workloads bench_shared_prefix --kv-tokens 0"), MAX_SECONDS its time limit
#   cascade   (one GPU) cascade decode attention: benchmarks/decode_profile.py --sections cascade
#             (plain vs cascade kernels on groups sharing a prefix), then multi_gpu_bench.py
#             --sections replicas on `radixd bench`'s shared-prefix workload (pools from free
#             memory): cascade off/on, the whole workload and one dp=2 replica's share under
#             cache-aware routing and under round robin
#   tests2    the GPU-marked tests of the second wave: quantized weights and kernels, the fp8 KV
#             cache, sliding windows, speculative verify and EAGLE-3 heads, the PD copy, MoE
#   wave2     the GPU second wave's table in one call (PEER=hf_baseline.py, HTTP=gpu_http.py,
#             TOK=a tokenizer directory): ceilings, decode at batch 1/64/256 with the peer (plain
#             and static), extend attention vs SDPA, the 32k-token prompt, the small model's idle
#             share at batch 64, HTTP+SSE vs in-process; each piece capped so all get their turn
#   mixed     benchmarks/mixed_step.py: a mixed step's attention (decodes beside a prompt chunk)
#             through the extend kernel alone against extend + decode kernels
#   pdl       programmatic dependent launch: tests/test_pdl.py's GPU tests, then decode with
#             it on and off: gpu_bench --sections ceilings,pdl; moe --sections ceilings,decode --pdl
#   merge     decode attention's split merge in its first kernel against a second kernel: the
#             kernels alone (decode_profile --sections merge), then decode at batch 1 with the
#             engine option decode_merge_in_kernel on and off (gpu_bench --sections ceilings,merge)
#   mixedload the GPU tests of the mixed steps' graphs and the Triton kernels, then
#             benchmarks/mixed_load.py (in process, 8B shape, 512 prompts at 256 streams) per
#             setting: no budget, eager; 1024 eager; 384, the default (512), 768 replayed
#             (MIXED_SETTINGS: others)
#   quant fp8kv swa spec pd moe (FP8KV_ARGS=--sweep: the decode kernel's tiles first; QUANT_ARGS=--pdl)
#             benchmarks/quant.py (bf16, fp8 and int4 engines at the 8B shape), fp8_kv.py (batch
#             256 x 4k, fp8 vs bf16 KV), swa.py (Gemma-3-12B shape at 8k), spec.py --device cuda,
#             pd.py --preset h200, moe.py (PEER=path adds the transformers peer; MOE_ARGS e.g.
#             "--sections ceilings,decode --quant fp8-block": Qwen3-30B-A3B-FP8's layout)
#
# PART:SECONDS stops that part after SECONDS in all (its logs so far are kept; a command that
# has no time left is skipped), so one call's parts all get their turn inside the machine's
# time limit.
set -u
OUT=$1
shift
PARTS=${*:-tests gpu tp dp}
cd "$(dirname "$0")/.."
mkdir -p "$OUT/work"
W=$OUT/work
# NVLink multicast stays off.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
if [ -n "${WHEELS:-}" ]; then  # packages the machine lacks, for every part
  python3 -m pip install -q --no-deps --target /tmp/radixd-deps "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/radixd-deps${PYTHONPATH:+:$PYTHONPATH}
fi
# lim CMD...: CMD under what is left of its part's SECONDS (nothing once they are spent), so a
# part of several commands ends within its limit; without a limit, CMD as it is
lim() {
  [ -z "$deadline" ] && { "$@"; return; }
  left=$(( deadline - $(date +%s) ))
  if [ "$left" -le 0 ]; then echo "($part: no time left for $*)"; return 124; fi
  timeout -k 10 "$left" "$@"
}
for spec in $PARTS; do
  part=${spec%%:*}
  start=$(date +%s)
  deadline=; [ "$part" != "$spec" ] && deadline=$(( start + ${spec#*:} ))
  case $part in
  tests)
    python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_triton_kernels.py \
        tests/test_gpu_decode.py tests/test_peer_allreduce_gpu.py tests/test_nccl_gpu.py > "$W/tests.txt" 2>&1
    tail -3 "$W/tests.txt" ;;
  gpu)
    python3 -m benchmarks.gpu_bench --out "$W/gpu" --sections ceilings,correct,fusions,rows,decode --batches 1,64 \
        > "$W/gpu.log" 2>&1
    grep '^==' "$W/gpu.log" | cut -c1-900 ;;
  profile)
    python3 -m benchmarks.decode_profile --out "$W/profile" --sections "${PROFILE:-step,kernels,fused}" \
        > "$W/profile.log" 2>&1
    grep '^==' "$W/profile.log" | cut -c1-1500 ;;
  full)
    python3 -m benchmarks.gpu_bench --out "$W/full" --peer "${PEER:?PEER=path/to/hf_baseline.py}" \
        --peer-flavours plain,static --peer-batches 1,64 > "$W/full.log" 2>&1
    grep '^==' "$W/full.log" | cut -c1-900 ;;
  tp|dp)  # dp streams every 8th token (a server's usual setting), tp every token
    interval=1; [ "$part" = dp ] && interval=8
    python3 -m benchmarks.multi_gpu_bench --out "$W/$part" --sections "$part" --stream-interval $interval \
        --max-seconds "${MAX_SECONDS:-280}" ${MULTI_ARGS:-} > "$W/$part.log" 2>&1
    tail -4 "$W/$part.log" | cut -c1-600 ;;
  cascade)
    python3 -m benchmarks.decode_profile --out "$W/cascade" --sections cascade > "$W/cascade_profile.log" 2>&1
    grep '^cascade' "$W/cascade_profile.log" | cut -c1-400
    python3 -m benchmarks.multi_gpu_bench --out "$W/replicas" --sections replicas --dp-workloads bench_shared_prefix \
        --kv-tokens 0 --stream-interval 8 --max-seconds "${MAX_SECONDS:-280}" > "$W/replicas.log" 2>&1
    grep '^replicas' "$W/replicas.log" | tail -3 | cut -c1-400 ;;
  tests2)
    # (a test stuck past 150 s fails with its stack, so the summary still comes)
    lim python3 -m pytest -q -p no:cacheprovider -rf --tb=short --timeout 150 -m gpu \
        tests/test_quant_gpu.py tests/test_fp8_kv.py tests/test_swa.py tests/test_speculative.py \
        tests/test_eagle3.py tests/test_pd_units.py tests/test_quant_kernels.py tests/test_moe.py > "$W/tests2.txt" 2>&1
    lim python3 -m pytest -q -p no:cacheprovider -rf -m "gpu or not gpu" tests/test_window_attention.py \
        "tests/test_fp8_kv.py::test_fp8_pool_read_by_a_bf16_query_takes_fp16_products" >> "$W/tests2.txt" 2>&1
    grep -E "passed|failed|error" "$W/tests2.txt" | tail -4 ;;
  wave2)
    # each piece capped (the daemon and the engine each start an 8B engine and capture its
    # graphs: the HTTP piece needs about 240 s on an H100); PEER_FLAVOURS=plain leaves out the
    # compiled peer where it cannot compile inside its limit
    timeout -k 10 230 python3 -m benchmarks.gpu_bench --out "$W/wave2/gpu" --sections ceilings,decode,peer \
        --batches 1,64,256 --peer "${PEER:?PEER=path/to/hf_baseline.py}" --peer-flavours "${PEER_FLAVOURS:-plain,static}" \
        --peer-batches 1,64 --peer-timeout 100 > "$W/wave2_gpu.log" 2>&1
    grep '^==' "$W/wave2_gpu.log" | cut -c1-700
    timeout -k 10 250 python3 "${HTTP:?HTTP=path/to/gpu_http.py}" --proj . --tok "${TOK:?TOK=tokenizer dir}" \
        --out "$W/wave2/http" > "$W/wave2_http.json" 2> "$W/wave2_http.err"
    cut -c1-900 "$W/wave2_http.json"
    timeout -k 10 45 python3 -m benchmarks.extend_attention --out "$W/wave2/extend" \
        --configs "(64,64,4,3,True,4);(128,64,8,3,True,4)" --small-configs "(16,32,4,2,False,1)" \
        > "$W/wave2_extend.log" 2>&1
    tail -6 "$W/wave2_extend.log" | cut -c1-300
    timeout -k 10 55 python3 -m benchmarks.long_prefill --out "$W/wave2/long" --prompts 2 > "$W/wave2_long.log" 2>&1
    grep '^==' "$W/wave2_long.log" | cut -c1-500
    timeout -k 10 55 python3 -m benchmarks.gpu_bench --out "$W/wave2/small" --model smollm2-135m \
        --sections decode --batches 64,64,64 --decode-new 512 > "$W/wave2_small.log" 2>&1
    grep '^==' "$W/wave2_small.log" | cut -c1-500 ;;
  mixed)
    lim python3 -m benchmarks.mixed_step --out "$W/mixed_step.json" > "$W/mixed.log" 2>&1
    tail -4 "$W/mixed.log" | cut -c1-400 ;;
  pdl)
    # programmatic dependent launch: its GPU tests, then decode on/off (8B shape at batch 1 and
    # 64; Qwen3-30B-A3B's shape at batch 1 and 16)
    lim python3 -m pytest -q -p no:cacheprovider -rf --tb=short -m gpu tests/test_pdl.py > "$W/pdl_tests.txt" 2>&1
    grep -E "passed|failed|error" "$W/pdl_tests.txt" | tail -3
    lim python3 -m benchmarks.gpu_bench --out "$W/pdl" --sections ceilings,pdl > "$W/pdl.log" 2>&1
    tail -3 "$W/pdl.log" | cut -c1-600
    lim python3 -m benchmarks.moe --out "$W/moe_pdl" --sections ceilings,decode --pdl > "$W/moe_pdl.log" 2>&1
    grep -v '^ ' "$W/moe_pdl.log" | tail -4 | cut -c1-600 ;;
  merge)
    lim python3 -m pytest -q -p no:cacheprovider -rf --tb=short -m "gpu or not gpu" tests/test_triton_kernels.py \
        -k merged_in_stage_one > "$W/merge_tests.txt" 2>&1
    grep -E "passed|failed|error" "$W/merge_tests.txt" | tail -3
    lim python3 -m benchmarks.decode_profile --out "$W/merge" --sections merge > "$W/merge.log" 2>&1
    grep '^merge' "$W/merge.log" | cut -c1-400
    lim python3 -m benchmarks.gpu_bench --out "$W/merge_engine" --sections ceilings,merge > "$W/merge_engine.log" 2>&1
    tail -3 "$W/merge_engine.log" | cut -c1-600 ;;
  mixedload)
    # the mixed steps' graphs and GPU tests, then in-process inter-token latency by setting
    lim python3 -m pytest -q -p no:cacheprovider -rf --tb=short -m gpu tests/test_mixed_graphs.py \
        tests/test_triton_kernels.py > "$W/mixedload_tests.txt" 2>&1
    grep -E "passed|failed|error" "$W/mixedload_tests.txt" | tail -3
    lim python3 -m benchmarks.mixed_load --out "$W" --settings "${MIXED_SETTINGS:-mixed_prefill_tokens=4096,mixed_cuda_graphs=0;\
mixed_prefill_tokens=1024,mixed_cuda_graphs=0;mixed_prefill_tokens=384;mixed_prefill_tokens=0;mixed_prefill_tokens=768}" > "$W/mixed_load.log" 2>&1
    tail -7 "$W/mixed_load.log" | cut -c1-400 ;;
  quant)
    lim python3 -m benchmarks.quant --json "$W/quant.json" ${QUANT_ARGS:-} > "$W/quant.log" 2>&1
    tail -12 "$W/quant.log" | cut -c1-400 ;;
  fp8kv)
    lim python3 -m benchmarks.fp8_kv --out "$W/fp8_kv.json" ${FP8KV_ARGS:-} > "$W/fp8_kv.log" 2>&1
    grep -E "best|fp8_kv batch" "$W/fp8_kv.log" | cut -c1-700 ;;
  swa)
    lim python3 -m benchmarks.swa --out "$W/swa" > "$W/swa.log" 2>&1
    tail -6 "$W/swa.log" | cut -c1-400 ;;
  spec)
    lim python3 -m benchmarks.spec --device cuda --out "$W/spec" > "$W/spec.log" 2>&1
    tail -14 "$W/spec.log" | cut -c1-400 ;;
  pd)
    lim python3 -m benchmarks.pd --preset h200 --out "$W/pd" > "$W/pd.log" 2>&1
    tail -8 "$W/pd.log" | cut -c1-400 ;;
  moe)
    lim python3 -m benchmarks.moe --out "$W/moe" ${PEER:+--peer "$PEER"} ${MOE_ARGS:-} > "$W/moe.log" 2>&1
    grep -v '^ ' "$W/moe.log" | tail -10 | cut -c1-400 ;;
  *) echo "unknown part: $part" ;;
  esac
  echo "-- $part: $(( $(date +%s) - start )) s"
done
tar czf "$OUT/results.tgz" -C "$W" . && rm -rf "$W"
