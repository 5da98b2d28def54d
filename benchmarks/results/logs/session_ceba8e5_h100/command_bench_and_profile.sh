set -u
REV=$1; OUT=${OUT:-/tmp/out}; L=benchmarks/results/logs/session_ceba8e5_h100
export PYTHONPATH=$PWD:${PYTHONPATH:-} CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
ARGS="--variants default deterministic deterministic_two_dq_writers --head-dims 64 128 --seq-lens 1024 4096"
JAX_PLATFORMS=cpu timeout 200 python3 benchmarks/attention_backward.py --precompile-only --precompile-workers 12 $ARGS > $OUT/precompile.log 2>&1
tail -1 $OUT/precompile.log
timeout 200 python3 benchmarks/attention_backward.py --out $OUT/backward_two_dq_writers.json $ARGS \
  --iterations 10 --variants-passing $L/backward_deterministic_tests.log > $OUT/backward_two_dq_writers.log 2>&1
echo "bench rc=$?"; tail -12 $OUT/backward_two_dq_writers.log
NCU_ARGS="--replay-mode application" LIBRARIES=fa4_jax timeout 250 bash benchmarks/device/profile_attention.sh forward "2 8192 16/16 128" 2>&1 | tail -20
