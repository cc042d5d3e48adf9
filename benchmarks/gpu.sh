#!/usr/bin/env bash
# Every GPU benchmark in one command, each stage under its own time limit so that a slow stage cannot
# take the others' time (a lent GPU machine gives minutes, not hours):
#
#     bash benchmarks/gpu.sh OUT_DIR [WHEELS_DIR] [kernels|e2e|all]
#
# `kernels` (about 4 minutes on an H200): attention, the decode kernel's sweep, the quantized cache (with the
# codes kernel); `e2e` (about 6): the 1B and 8B shapes against transformers + kvpress, and AdaKV. A device call
# is limited to 10 minutes, so run them as two calls, or `all` where a call may run longer.
# WHEELS_DIR (optional): wheels installed first with pip --no-index, for the e2e stage's transformers + kvpress
# columns on a machine without a network: kvpress 0.5.5, the transformers < 5.3 it needs, and what they import.
# Made here (a network) with, for a Python 3.12 machine:
#     pip download --no-deps -d .whl kvpress==0.5.5 transformers==5.2.0 datasets==5.2.0 cachetools==5.5.2 \
#         termcolor==3.3.0 dill==0.4.1 typer-slim==0.24.0 && pip wheel --no-deps -w .whl fire==0.6.0
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation py --abi none \
#         --platform any -d .whl multiprocess==0.70.19
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux2014_x86_64 -d .whl tokenizers==0.22.2 Writes every
# stage's tables under OUT_DIR/results and its log to OUT_DIR/logs; copy the tables you keep into
# benchmarks/results/.
set -u
out=${1:?usage: bash benchmarks/gpu.sh OUT_DIR [WHEELS_DIR] [kernels|e2e|all]}
wheels=${2:-}
part=${3:-all}
case $part in kernels|e2e|all) ;; *) echo "gpu.sh: part '$part' is not one of kernels, e2e, all" >&2; exit 2;; esac
mkdir -p "$out/results" "$out/logs"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -n "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site || echo "wheels not installed" >&2
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import jax, torch, transformers; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "import kvpress; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else 'ok')"
} 2>&1 | tee "$out/logs/env.txt"

stage() {  # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=5 "$limit" "$@" > "$out/logs/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc in $((SECONDS - t0)) s"
    tail -n 4 "$out/logs/$name.log"
}

r=$out/results
if [ "$part" != e2e ]; then
stage attention 100 python3 -m benchmarks.attention --common 4096,8192,16384,32768 --prefill 8192,16384 --masked 0,0.9 \
    --decode 4096,32768,65536 --decode-batches 1,8 --out "$r"
stage decode_tuning 100 python3 -m benchmarks.decode_tuning --lengths 32768 --batches 1,8 --blocks 64,128,256 \
    --splits 16,32,64,128 --warps 4,8 --stages 1,2,3 --out "$r"
stage quant 150 python3 -m benchmarks.quant --lengths 4096,16384,65536 --steps 32 --kernel --out "$r"
stage quant_8b 240 python3 -m benchmarks.quant --lengths 4096,16384,65536 --steps 32 --kernel --shape llama-3.1-8b \
    --batch 8 --no-variants --out "$r"
fi
if [ "$part" != kernels ]; then
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 stage e2e_1b 170 python3 -m benchmarks.e2e --shape llama-3.2-1b --dtype bfloat16 \
    --lengths 4096,32768 --batches 1 --max-batch-tokens 262144 --policies full,streaming,snapkv,'snapkv chunked 512' \
    --attention-impl pallas --compile-layers '' --new 32 --out "$r"
stage adakv 90 python3 -m benchmarks.adakv --lengths 4096,16384 --attention-impl pallas --out "$r"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 stage e2e_8b 240 python3 -m benchmarks.e2e --shape llama-3.1-8b --dtype bfloat16 \
    --lengths 4096,32768 --batches 1 --max-batch-tokens 262144 --policies full,snapkv --attention-impl pallas \
    --compile-layers '' --new 16 --repeats 1 --out "$r"
fi
