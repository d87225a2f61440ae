#!/usr/bin/env bash
# Every check this project runs on a GPU host, in one go, most important first, inside a time
# budget.  The machine's python3 must already have torch with CUDA; meshdsl is installed from
# this checkout (lark from ./.whl where the machine lacks it; no network needed).  Nothing in
# the test suite needs a GPU: this is where the GPU paths get exercised.
#
#   bash bench/gpu_checks.sh [OUT_DIR] [BUDGET_S]   # into OUT_DIR (default gpu_out/): gpu.log, cpu.log,
#                                                   # status.txt and json.tar.gz (each bench's JSON)
#   GPU_CHECKS_ONLY="agreement dense_large" bash bench/gpu_checks.sh OUT 280   # those steps alone
#
# Two lanes run side by side on disjoint cores (taskset), so neither slows the other:
#   gpu lane (the first half of the cores): the GPU benches, tests/test_device.py, `meshdsl
#     check/train/run --device cuda`, the GPU memory bench;
#   cpu lane (the second half, CUDA hidden): the gloo benches that want spare cores
#     (data parallel against its no-communication bound, the pipeline schedules).
# A step starts only if the budget (default 540 s from the start) leaves it 30 s; its timeout
# is the smaller of its own and what the budget has left.  The summary lists each step's exit
# code (124: timed out, "skipped": no time left).
set -u
out=${1:-gpu_out}
budget=${2:-540}
mkdir -p "$out" "$out/json"
export PYTHONUNBUFFERED=1
start=$SECONDS
ncpu=$(nproc)
half=$((ncpu / 2))
gpu_cores="0-$((half - 1))"
cpu_cores="$half-$((ncpu - 1))"
export TORCHINDUCTOR_COMPILE_THREADS=$half

step() {  # step LOG NAME SECONDS CORES COMMAND...: run under taskset, append to LOG
    local log=$1 name=$2 secs=$3 cores=$4; shift 4
    if [ -n "${GPU_CHECKS_ONLY:-}" ] && [[ " $GPU_CHECKS_ONLY install " != *" $name "* ]]; then return; fi
    local left=$((budget - (SECONDS - start)))
    if [ "$left" -lt 30 ]; then echo "$name skipped" >>"$out/status.txt"; return; fi
    [ "$secs" -gt "$((left - 5))" ] && secs=$((left - 5))
    local t0=$SECONDS
    echo "=== $name ($(date -u +%H:%M:%S), ${secs}s at most): $*" >>"$log"
    timeout -k 5 "$secs" taskset -c "$cores" "$@" >>"$log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" >>"$out/status.txt"
}

{
    nvidia-smi -L
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
    echo "cores: $ncpu (gpu lane $gpu_cores, cpu lane $cpu_cores)"
} >"$out/gpu.log" 2>&1
: >"$out/status.txt"
if ! python3 -c "import lark" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/lark-*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
step "$out/gpu.log" install 90 "0-$((ncpu - 1))" python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile .

cpu_lane() {
    export CUDA_VISIBLE_DEVICES=
    step "$out/cpu.log" dp_gloo 150 "$cpu_cores" python3 bench/distributed_gpt.py --no-memory \
        --only "torch,meshdsl 1p,bound (no comm),DDP,meshdsl DP"
    cp bench/results/distributed_gpt.json "$out/json/distributed_gpt_cpu_lane.json" 2>/dev/null
    step "$out/cpu.log" pipeline_gloo 240 "$cpu_cores" python3 bench/pipeline.py --ms 8 --rounds 3 --reps 2
    cp bench/results/pipeline.json "$out/json/pipeline_cpu_lane.json" 2>/dev/null
}
cpu_lane &
lane=$!

# The dense bench on CUDA: meshdsl eager and --compile (the whole step as one CUDA graph), eager
# torch (SDPA), torch.compile and torch.compile(mode="reduce-overhead") of the same twin.
big=d_model=1024,heads=16,d_head=64,d_ff=4096,layers=8,seq=512,batch=16
g() { step "$out/gpu.log" "$@"; }
g dense_large 200 "$gpu_cores" python3 bench/dense_vs_torch.py --device cuda --plan --rounds 3 --reps 10 \
    --config $big --out "$out/json/dense_large_cuda.json"
g dense 200 "$gpu_cores" python3 bench/dense_vs_torch.py --device cuda --plan --rounds 3 --reps 15 \
    --out "$out/json/dense_cuda.json"
g tests 150 "$gpu_cores" python3 -m pytest -q -p no:cacheprovider tests/test_device.py
g check_tp 60 "$gpu_cores" meshdsl check transformer --mesh "data:2; model:2" \
    --layout "batch:data; d_ff:model; heads:model" --device cuda
g check_pipe 60 "$gpu_cores" meshdsl check transformer --tiny --mesh "stage:2; data:2" \
    --layout "layer:stage; batch:data" --microbatches 2 --schedule 1f1b --device cuda
g check_moe 60 "$gpu_cores" meshdsl check moe --tiny --mesh "data:2" --layout "batch:data; experts:data" \
    --optimizer adamw --device cuda
g train 90 "$gpu_cores" meshdsl train --steps 200 --out /tmp/train --checkpoint /tmp/ckpt --save-every 100 --device cuda
g train_resume 60 "$gpu_cores" meshdsl train --steps 260 --out /tmp/train2 --checkpoint /tmp/ckpt --resume --device cuda
g run_nccl 60 "$gpu_cores" meshdsl run transformer --mesh data:1 --nproc 1 --steps 20 --report "$out/json/run_nccl.json"
g dense_llama 200 "$gpu_cores" python3 bench/dense_vs_torch.py --device cuda --plan --rounds 3 --reps 15 \
    --model llama --out "$out/json/dense_llama_cuda.json"
g memory 90 "$gpu_cores" python3 bench/memory.py --device cuda --quick --out "$out/json/memory_cuda.json"
g tests_math 120 "$gpu_cores" env MESHDSL_ATTENTION=math python3 -m pytest -q -p no:cacheprovider tests/test_device.py
# which part of --compile made the large size's layer-norm gradients wrong on an H100 (2 layers;
# pinned down on 2026-11-27: inductor's decomposed layer-norm backward), kept as a last check
g agreement 150 "$gpu_cores" python3 bench/compile_agreement.py --device cuda \
    --config "${big/layers=8/layers=2}" --out "$out/json/agreement_cuda.json"
wait $lane
tar -czf "$out/json.tar.gz" -C "$out" json && rm -rf "$out/json"
cat "$out/status.txt"
