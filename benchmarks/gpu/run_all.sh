#!/usr/bin/env bash
# The GPU checks of issues 55 and 74 in one command, each section in its own process with its own time
# cap, within one overall budget; a section that fails or runs out of time is logged and the
# next one runs. Every figure is printed and appended to $OUT/results.jsonl.
#
#   bash benchmarks/gpu/run_all.sh            # on the GPU machine (JAX_PLATFORMS=cuda)
#   bash benchmarks/gpu/run_all.sh --tiny     # a CPU check of the scripts (tiny shapes)
#
# Environment: OUT (default out/gpu), GPU_BUDGET_S (seconds for all sections, default 430),
# ZX_STAGE (where the package is staged, default /tmp/zx), ZX_JOBS (pytest workers, default 8),
# ZX_SECTIONS (space-separated section names to run, default all: e.g. a second call on the
# same warm machine, whose compilation cache then holds the first call's programs).
set -u
cd "$(dirname "$0")/../.."
TINY=""
[ "${1:-}" = "--tiny" ] && TINY="--tiny"
export OUT="${OUT:-$PWD/out/gpu}"
mkdir -p "$OUT"
START=$SECONDS
BUDGET="${GPU_BUDGET_S:-430}"
[ -n "$TINY" ] && BUDGET="${GPU_BUDGET_S:-1500}"

# The package as a wheel installs it: zeroxla with models/ and pallas_kernels/ inside
# (pyproject's package-dir). PYTHONPATH=$PWD alone would give no `zeroxla.models`.
STAGE="${ZX_STAGE:-/tmp/zx}"
rm -rf "$STAGE" && mkdir -p "$STAGE"
cp -r zeroxla "$STAGE/zeroxla" && cp -r models "$STAGE/zeroxla/models" \
  && cp -r pallas_kernels "$STAGE/zeroxla/pallas_kernels" || { echo "staging failed"; exit 2; }
export PYTHONPATH="$STAGE${PYTHONPATH:+:$PYTHONPATH}"
# A rerun on the same machine loads its programs instead of compiling them again.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$STAGE-jax-cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
if [ -n "$TINY" ]; then export JAX_PLATFORMS=cpu; else export JAX_PLATFORMS=cuda; fi
PY=python3
G=benchmarks/gpu

section() {  # section NAME CAP_SECONDS COMMAND...: run within min(cap, budget left)
  local name=$1 cap=$2
  shift 2
  if [ -n "${ZX_SECTIONS:-}" ] && [[ " $ZX_SECTIONS " != *" $name "* ]]; then return; fi
  local left=$((BUDGET - (SECONDS - START)))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 20 ]; then
    echo "=== $name: SKIPPED ($left s of the ${BUDGET} s budget left)"
    echo "{\"section\": \"run_all\", \"part\": \"$name\", \"skipped\": \"$left s left\"}" >> "$OUT/results.jsonl"
    return
  fi
  echo
  echo "=== $name (cap ${limit} s, at $((SECONDS - START)) s) $(date -u +%H:%M:%S)"
  local s0=$SECONDS
  timeout -k 10 "$limit" "$@"
  local rc=$?
  local note=""
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && note=" (TIMED OUT)"
  echo "=== $name: exit $rc$note after $((SECONDS - s0)) s"
  echo "{\"section\": \"run_all\", \"part\": \"$name\", \"exit\": $rc, \"seconds\": $((SECONDS - s0))}" >> "$OUT/results.jsonl"
}

env_facts() {
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv | tee "$OUT/nvidia-smi.txt"
  $PY -P -c "import zeroxla, zeroxla.models, zeroxla.pallas_kernels as p; print('zeroxla from', zeroxla.__file__, '| kernels from', p.__file__)" || return 3
  $PY $G/env.py
}

kernel_tests() {
  # All of tests/pallas_kernels runs on one device; the *Interpret twins check the interpreted
  # kernel, which the CPU suite already does, so the GPU run takes the compiled (impl="auto")
  # ones. Workers share the GPU: no preallocation.
  local files="tests/pallas_kernels" jobs="${ZX_JOBS:-8}"
  [ -n "$TINY" ] && files="tests/pallas_kernels/test_quantize.py" && jobs=0
  XLA_PYTHON_CLIENT_PREALLOCATE=false $PY -P -m pytest -q -p no:cacheprovider -n "$jobs" \
    --maxfail=10 --tb=short -k "not Interpret" $files 2>&1 | tee "$OUT/kernel_tests.txt"
  local rc=${PIPESTATUS[0]}
  local summary
  summary=$(grep -E "[0-9]+ (passed|failed|error)" "$OUT/kernel_tests.txt" | tail -1)
  $PY -c 'import json, sys; print(json.dumps({"section": "kernel_tests", "summary": sys.argv[1], "exit": int(sys.argv[2])}))' \
    "$summary" "$rc" | tee -a "$OUT/results.jsonl"
  return "$rc"
}

pallas_route_tests() {
  # The Pallas flash attention route against float64 softmax attention and a family's naive
  # route, compiled (not interpreted) on the GPU.
  XLA_PYTHON_CLIENT_PREALLOCATE=false $PY -P -m pytest -q -p no:cacheprovider --tb=short \
    -k "outputs or family" tests/models/test_pallas_attention.py 2>&1 | tee "$OUT/pallas_route_tests.txt"
  return "${PIPESTATUS[0]}"
}

export -f env_facts kernel_tests pallas_route_tests
export PY G TINY
echo "run_all: budget ${BUDGET} s, OUT=$OUT, JAX_PLATFORMS=$JAX_PLATFORMS, stage $STAGE"
section env 60 bash -c env_facts
section kernel_tests 120 bash -c kernel_tests
section train_bf16_T1024 240 $PY $G/train_step.py $TINY --dtype bf16 --seq 1024 --batch 16 \
  --variants plain zero0 zero3 --timeout-each 100
section attention_routes 100 $PY $G/attention_routes.py $TINY
section attention_routes_packed 80 $PY $G/attention_routes.py $TINY --packed
section train_offload_T1024 150 $PY $G/train_step.py $TINY --dtype bf16 --seq 1024 --batch 16 \
  --variants zero3_offload zero3_infinity --timeout-each 70
section pallas_route_tests 60 bash -c pallas_route_tests
section train_packed_T8192 120 $PY $G/train_step.py $TINY --dtype bf16 --seq 8192 --batch 2 \
  --packed --variants plain zero3 --timeout-each 55
section train_packed_T8192_blockwise 70 $PY $G/train_step.py $TINY --dtype bf16 --seq 8192 \
  --batch 2 --packed --attention blockwise --variants zero3 --timeout-each 65
section stage3_overhead_T1024 200 $PY $G/train_step.py $TINY --dtype bf16 --seq 1024 \
  --batch 16 --variants plain zero3 zero3_no_prefetch zero3_persistent --timeout-each 50
section kernel_throughput 75 $PY $G/kernels.py $TINY
section generation 75 $PY $G/generation.py $TINY
section train_fp16_T1024 150 $PY $G/train_step.py $TINY --dtype fp16 --seq 1024 --batch 16 \
  --variants zero0 plain --timeout-each 90
section train_bf16_T8192 150 $PY $G/train_step.py $TINY --dtype bf16 --seq 8192 --batch 2 \
  --variants zero3 plain --timeout-each 90
# Issue 74: a production-shaped layer's MFU (Llama-3.1-8B's dims, 8 layers, AdamW), stage 3
# on one device against the plain step, the 8-GPU program on a mock topology, the rollout
# engine at a real width and decode against the memory-bandwidth floor.
section llama8b_T8192 200 $PY $G/train_step.py $TINY --model Llama-3.1-8B --layers 8 \
  --dtype bf16 --seq 8192 --batch 1 --steps 5 --variants plain zero3 --timeout-each 100
section llama8b_T4096 200 $PY $G/train_step.py $TINY --model Llama-3.1-8B --layers 8 \
  --dtype bf16 --seq 4096 --batch 2 --steps 5 --variants plain zero3 --timeout-each 100
section mock_topology 150 $PY $G/mock_topology.py $TINY --timeout-each 100
section rollout_real_width 120 bash -c 'set -o pipefail; $PY benchmarks/rollout.py \
  --model Qwen2.5-0.5B --repeats 1 --groups 0 --prompts 128 $([ -n "$TINY" ] && echo --prompts 8 \
  --max-new 16 --batch 4 --slots 8 --budget 12) 2>&1 | tee "$OUT/rollout.txt"'
section decode_floor 90 $PY $G/decode_floor.py $TINY
section stage3_one_device_T1024 120 $PY $G/train_step.py $TINY --dtype bf16 --seq 1024 \
  --batch 16 --variants plain zero3 --timeout-each 55
# Where the remaining MFU and the rollout's row-by-row differences come from: cuBLAS for every
# GEMM instead of XLA's Triton GEMMs; the float32 matmul precision XLA:GPU uses by default
# (TF32 or not) and the rollout comparison at full float32 precision.
section llama8b_T8192_cublas 120 env XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" \
  $PY $G/train_step.py $TINY --model Llama-3.1-8B --layers 8 --dtype bf16 --seq 8192 \
  --batch 1 --steps 5 --variants plain zero3 --timeout-each 55
section llama8b_T8192_whole_logits 70 $PY $G/train_step.py $TINY --model Llama-3.1-8B \
  --layers 8 --dtype bf16 --seq 8192 --batch 1 --steps 5 --variants plain_logits \
  --timeout-each 65
section llama8b_T8192_chunk4096 60 $PY $G/train_step.py $TINY --model Llama-3.1-8B --layers 8 \
  --dtype bf16 --seq 8192 --batch 1 --steps 5 --logits-chunk 4096 --variants zero3 \
  --timeout-each 55
section llama8b_T8192_chunk8192 60 $PY $G/train_step.py $TINY --model Llama-3.1-8B --layers 8 \
  --dtype bf16 --seq 8192 --batch 1 --steps 5 --logits-chunk 8192 --variants zero3 \
  --timeout-each 55
section f32_matmul_precision 30 $PY -c 'import jax, jax.numpy as jnp, numpy as np
x = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
exact = x.astype(np.float64) @ x.astype(np.float64)
for p in ("default", "highest"):
    with jax.default_matmul_precision(p):
        got = np.asarray(jax.jit(jnp.dot)(x, x), np.float64)
    print("RESULT", {"f32_matmul_precision": p, "max_rel_err": float(np.max(np.abs(got - exact)) / np.max(np.abs(exact)))})'
section rollout_real_width_highest 120 env JAX_DEFAULT_MATMUL_PRECISION=highest bash -c \
  'set -o pipefail; $PY benchmarks/rollout.py --model Qwen2.5-0.5B --repeats 1 --groups 0 \
  --prompts 128 $([ -n "$TINY" ] && echo --prompts 8 --max-new 16 --batch 4 --slots 8 \
  --budget 12) 2>&1 | tee "$OUT/rollout_highest.txt"'
echo
echo "run_all: done after $((SECONDS - START)) s; figures in $OUT/results.jsonl"
