#!/usr/bin/env bash
# gradsync's allreduce against real Horovod and ddp, interleaved (3 rounds), per model, with
# per-rank BatchNorm on every side (what Horovod's and DDP's users get): loopback, then 2
# emulated hosts at 1 Gbit/s (root). Needs a Python where horovod.torch imports (Horovod is
# not a dependency: build it with HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1).
#   SRC=$PWD PY=/path/to/venv/bin/python OUT=/tmp/hvdbench bash benchmarks/horovod_vs_allreduce.sh
# Results of 2026-11-28: docs/results/horovod/.
set -u
SRC=${SRC:-/tmp/bench-src}  # a clone of gradsync at the commit measured
export PYTHONPATH=$SRC
PY=${PY:-/tmp/hvdenv/bin/python}  # torch 2.13.0 (CPU) and Horovod 0.28.1 built with Gloo
cd $SRC
V=("ddp=--strategy ddp" "allreduce=--strategy allreduce" "allreduce-128=--strategy allreduce --fusion-threshold-mb 128 --first-bucket-mb 0" "horovod=--strategy horovod")
run() {  # name, common args
  echo "=== $1 ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"
  $PY benchmarks/interleaved.py --rounds 3 --out ${OUT:-/tmp/hvdbench}/$1 --common "$2 --workers 2 --threads 1 --steps 14 --deterministic --batchnorm local" "${V[@]}"
}
run transformer "--model transformer"
run vgg16 "--model vgg16"
run resnet56 "--model resnet56"
run lstm-sparse "--model lstm-lm --model-option sparse=true --model-option vocab=50000 --model-option sampled_softmax=512"
run mnist-cnn "--model mnist-cnn"
run transformer-1gbit "--model transformer --hosts 2 --bandwidth 1gbit"
run vgg16-1gbit "--model vgg16 --hosts 2 --bandwidth 1gbit"
echo "=== done $(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg)"
