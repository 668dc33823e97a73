#!/usr/bin/env bash
# The GPU checks of one session on a machine with one CUDA device: profiles for `predict`
# taken on the GPU, the NCCL path of the collective strategies, and what a user gets when
# a job asks for more GPUs than the machine has. Writes everything under OUT (default
# ./gpu-check; profiles and run summaries under OUT/profiles, then packed into
# OUT/gpu-check.tar.gz); every command is bounded, so the script always ends.
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-gpu-check}
mkdir -p "$OUT/profiles"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
log=$OUT/gpu-check.log
step() { echo "== $*" | tee -a "$log"; }
run() { # run LIMIT_S CMD...: the command's output into the log, its exit status after it
  local limit=$1; shift
  local started=$SECONDS
  timeout -k 5 "$limit" "$@" >>"$log" 2>&1
  echo "-- exit $? after $((SECONDS - started)) s" | tee -a "$log"
}

step "machine"
run 20 nvidia-smi -L
run 60 "$py" -c "import torch, torch.distributed as d; print(torch.__version__, torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version(), 'gloo', d.is_gloo_available())"
nproc | tee -a "$log"

step "profiles on the GPU (1 thread, float32)"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -cd 'A-Za-z0-9' | tr 'A-Z' 'a-z')
gpu=${gpu#nvidia}
# model, batch (0: the preset's), BatchNorm layers timed. resnet56 with local BatchNorm
# tells whether gradsync's global layer is why its profile was 3.2x its step (session 22).
for spec in "vgg16 32 global" "vgg16 128 global" "resnet56 32 global" "resnet56 32 local" \
  "resnet56 128 global" "transformer 0 global"; do
  set -- $spec
  batch=(); name=$1-$gpu-b$2
  if [ "$2" = 0 ]; then name=$1-$gpu; else batch=(--batch "$2"); fi
  [ "$3" = local ] && name=$name-local
  run 120 "$py" -m gradsync profile --device cuda --threads 1 --model "$1" ${batch[@]+"${batch[@]}"} \
    --batchnorm "$3" --steps 30 --warmup 10 --out "$OUT/profiles/$name.json"
done

step "the NCCL path: one rank per GPU"
for strategy in single allreduce ddp; do
  run 120 "$py" -m gradsync train --device cuda --threads 1 --strategy "$strategy" --workers 1 \
    --model resnet56 --steps 60 --out "/tmp/gpu-$strategy" --overwrite
  "$py" -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['strategy'], d['throughput'], d['step_time_s_median'], d['environment']['cuda'])" "/tmp/gpu-$strategy/summary.json" 2>&1 | tee -a "$log"
  cp "/tmp/gpu-$strategy/summary.json" "$OUT/profiles/train-$strategy.json" 2>/dev/null
done

tar -czf "$OUT/gpu-check.tar.gz" -C "$OUT" profiles && rm -r "$OUT/profiles"

step "verify on the GPU: single against allreduce and ddp at one rank (float64, NCCL)"
run 180 "$py" -m gradsync verify --device cuda --model resnet56 --preset tiny --strategies allreduce,ddp \
  --workers 1 --steps 10 --out /tmp/gpu-verify --overwrite

step "more ranks than GPUs, and server strategies, on a machine with one GPU"
run 60 "$py" -m gradsync train --device cuda --strategy allreduce --workers 2 --model resnet56 --steps 5 --out /tmp/gpu-two --overwrite
run 120 "$py" -m gradsync train --strategy allreduce --workers 2 --model resnet56 --preset tiny --steps 5 --out /tmp/gpu-auto --overwrite
"$py" -c "import json; print(json.load(open('/tmp/gpu-auto/summary.json'))['environment'])" 2>&1 | tee -a "$log"
run 60 "$py" -m gradsync train --device cuda --strategy ps --workers 1 --model resnet56 --steps 5 --out /tmp/gpu-ps --overwrite

device_of() { # the device a run's summary records
  "$py" -c "import json,sys; print(sys.argv[1], json.load(open(sys.argv[1] + '/summary.json'))['environment'].get('device'))" "$1" 2>&1 | tee -a "$log"
}

step "non-affine and batch-only BatchNorm, tied, gated, frozen parameters on CUDA (float64, one rank)"
run 180 "$py" -m gradsync verify --device cuda --model tests/models/adversarial.py:build_dense \
  --strategies allreduce,ddp --workers 1 --steps 10 --out /tmp/gpu-adversarial --overwrite

step "resume on the GPU: 10 steps, then resumed to 20, against 20 uninterrupted (bit-identical)"
resume=(train --device cuda --strategy allreduce --workers 1 --model resnet56 --preset tiny --checkpoint-every 10)
run 120 "$py" -m gradsync "${resume[@]}" --steps 20 --out /tmp/gpu-whole --overwrite
run 120 "$py" -m gradsync "${resume[@]}" --steps 10 --out /tmp/gpu-cut --overwrite
run 120 "$py" -m gradsync "${resume[@]}" --steps 20 --resume /tmp/gpu-cut
run 60 "$py" -m gradsync compare --tolerance 0 /tmp/gpu-whole /tmp/gpu-cut

step "torchrun: the rendezvous compares GPU UUIDs (one rank: the GPU; two on one GPU: the CPU, or refused with --device cuda)"
torchrun() { # torchrun NPROC OUT [FLAGS...]
  local nproc=$1 out=$2; shift 2
  run 120 "$py" -m torch.distributed.run --nproc-per-node "$nproc" --master-port 29533 -m gradsync \
    train --strategy allreduce --model resnet56 --preset tiny --steps 10 --out "$out" --overwrite "$@"
}
torchrun 1 /tmp/gpu-torchrun1
device_of /tmp/gpu-torchrun1
torchrun 2 /tmp/gpu-torchrun2
device_of /tmp/gpu-torchrun2
torchrun 2 /tmp/gpu-torchrun3 --device cuda

step "the fast test tier with CUDA visible"
run 240 "$py" -m pytest -m "not slow" -q -rf -p no:warnings -p no:cacheprovider --timeout 60 --maxfail=6 tests
