#!/usr/bin/env bash
# predict's validation on a machine with cores to spare (a lent device machine: 16 cores),
# where the emulated hosts' ranks do not share cores. Stops the measuring at LIMIT seconds
# and summarizes what ran; run again on the same machine to go on (the validation resumes
# its own plan's cells in WORK). Writes the log, validation.md, cells.jsonl and a tarball
# of profiles and calibrations under OUT.
#   OUT=/tmp/v LIMIT=480 bash benchmarks/device_validation.sh
# Needs root, ip and tc. The lent machines' image has no iproute2 (session 25): copy this
# machine's ip and tc, and the libraries ldd lists for them that the image lacks (libbpf,
# libmnl, libbsd, libxtables, libmd), into an ignored folder, carry it, and put it first
# on PATH and LD_LIBRARY_PATH in the command.
set -u
OUT=${OUT:-device-validation}
WORK=${WORK:-/tmp/device-validation}
LIMIT=${LIMIT:-480}
PLAN=${PLAN:-experiments/predict-validation-manycores.toml}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
log=$OUT/validation.log
{ nproc; lscpu | grep -E 'Model name'; uptime; "$py" -c 'import torch; print(torch.__version__)'; } 2>&1 | tee -a "$log"
if ! { ip netns add gs-probe && ip netns del gs-probe && command -v tc; } >>"$log" 2>&1; then
  echo "no network namespaces or tc here: nothing to validate on" | tee -a "$log"
  exit 3
fi
started=$SECONDS
timeout -k 10 "$LIMIT" "$py" -m gradsync predict --validate "$PLAN" --out "$WORK" 2>&1 | tee -a "$log"
echo "-- exit ${PIPESTATUS[0]} after $((SECONDS - started)) s" | tee -a "$log"
"$py" -c 'import sys; from pathlib import Path; from gradsync.predict.validate import load_plan, summarize_measured
s = summarize_measured(load_plan(sys.argv[1]), Path(sys.argv[2])); print(s["num_ok"], "cells", s["median_abs_error"], s["p90_abs_error"])' "$PLAN" "$WORK" 2>&1 | tee -a "$log"
cp "$WORK/validation.md" "$WORK/cells.jsonl" "$OUT/" 2>/dev/null
tar -czf "$OUT/validation.tar.gz" -C "$WORK" --exclude='*.safetensors' .
uptime | tee -a "$log"
