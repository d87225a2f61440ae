#!/usr/bin/env bash
# Every check this project runs on a GPU, in one go, on a machine whose python3 already has
# torch with CUDA (meshdsl itself is installed from this checkout; no network needed).
# Nothing in the test suite needs a GPU: this is where the GPU paths get exercised.
#
#   bash bench/gpu_checks.sh [OUT_DIR]        # logs and JSON results into OUT_DIR (default gpu_out/)
#
# Each check runs under its own timeout and the script goes on after a failure; the summary
# at the end lists each check's exit code.
set -u
out=${1:-gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=()
step() {  # step NAME SECONDS COMMAND...: run, log into $out/NAME.log, remember the exit code
    local name=$1 secs=$2; shift 2
    echo "=== $name: $*"
    local t0=$SECONDS
    timeout -k 5 "$secs" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-25}" "$out/$name.log"
    status+=("$name rc=$rc $((SECONDS - t0))s")
}
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
step install 60 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile .
step tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_device.py
step tests_math 120 env MESHDSL_ATTENTION=math python3 -m pytest -q -p no:cacheprovider tests/test_device.py
step attention_path 60 python3 -c "import importlib, torch; a = importlib.import_module('meshdsl.ops.attention'); q = torch.randn(16, 8, 64, 32, device='cuda'); a._forward(q, q, q, True, None, None); print('fused on CUDA in fp32, by d_head:', a._CUDA_FUSED)"
# The dense benches' rows on CUDA: meshdsl, eager torch (SDPA), torch.compile of the same twin and
# torch.compile(mode="reduce-overhead") (CUDA graphs); --hand-attention adds the old hand-written
# attention as a labelled row.  Compiling takes a minute or two per row, hence the timeouts.
# (meshdsl --compile rows, issue 37 item 2, go here once the executor compiles a plan.)
step dense 300 python3 bench/dense_vs_torch.py --device cuda --rounds 3 --reps 15 --hand-attention
step dense_update 300 python3 bench/dense_vs_torch.py --device cuda --rounds 3 --reps 15 --update
step dense_plan 300 python3 bench/dense_vs_torch.py --device cuda --rounds 3 --reps 15 --update --plan
step dense_llama 300 python3 bench/dense_vs_torch.py --device cuda --rounds 3 --reps 15 --model llama
# gloo on a host with a GPU: FSDP2's and DTensor's meshes are built on the CPU, no CUDA_VISIBLE_DEVICES= needed
step gpt_gloo 300 python3 bench/distributed_gpt.py --quick --only "DDP,meshdsl DP,DTensor TP,meshdsl TP,FSDP2,meshdsl FSDP"
cp bench/results/distributed_gpt.json "$out"/distributed_gpt_gloo.json 2>/dev/null
step gpt_nccl 300 python3 bench/distributed_gpt.py --backend nccl --rounds 3
step check_tp 60 meshdsl check transformer --mesh "data:2; model:2" --layout "batch:data; d_ff:model; heads:model" --device cuda
step check_pipe 60 meshdsl check transformer --tiny --mesh "stage:2; data:2" --layout "layer:stage; batch:data" --microbatches 2 --schedule 1f1b --device cuda
step check_moe 60 meshdsl check moe --tiny --mesh "data:2" --layout "batch:data; experts:data" --optimizer adamw --device cuda
step run_nccl 60 meshdsl run transformer --mesh data:1 --nproc 1 --steps 20 --report "$out/run_nccl.json"
step train 90 meshdsl train --steps 200 --out "$out/train" --checkpoint "$out/ckpt" --save-every 100
step train_resume 60 meshdsl train --steps 260 --out "$out/train2" --checkpoint "$out/ckpt" --resume
big=d_model=1024,heads=16,d_head=64,d_ff=4096,layers=8,seq=512,batch=16
step dense_big 300 python3 bench/dense_vs_torch.py --device cuda --rounds 3 --reps 10 --config $big --hand-attention --out "$out/dense_big.json"
step dense_big_math 100 env MESHDSL_ATTENTION=math python3 bench/dense_vs_torch.py --device cuda --rounds 3 --reps 10 --config $big --no-compile --out "$out/dense_big_math.json"
step dense_big_update 300 python3 bench/dense_vs_torch.py --device cuda --rounds 3 --reps 10 --config $big --update --out "$out/dense_big_update.json"
step dense_profile 120 python3 bench/dense_vs_torch.py --device cuda --profile --no-compile
cp bench/results/*cuda*.json bench/results/distributed_gpt.json "$out"/ 2>/dev/null
printf '%s\n' "${status[@]}"
