#!/usr/bin/env bash
# The project's GPU checks in one bounded run, for a CUDA machine with no network (python3 there
# holds torch, transformers, triton, hypothesis, httpx, anyio; no uv):
#   bash scripts/gpu_checks.sh prepare     # here, with network: the wheels it lacks, into .whl/
#   bash scripts/gpu_checks.sh run [PARTS] # there, from the repository root (.whl/ carried along)
# PARTS (comma-separated, default all): tests (pytest -m cuda), ipc (benchmarks/bench_ipc.py),
# train (bench_cuda's train section: ours beside the TRL-style peer steps), logprobs (bench_cuda's
# log-prob kernels at H=3584), attention (bench_packed_attention.py). Each part has a time bound
# (the whole run about 9 minutes); its output goes to $OUT/<part>.txt where $OUT is set, else
# to /tmp/gpu-checks.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=(trio==0.32.0 outcome==1.3.0.post0 sniffio==1.3.1 liger-kernel==0.8.5)

if [ "${1:-}" = "prepare" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}"
  ls .whl
  exit
fi
if [ "${1:-}" != "run" ]; then
  echo "usage: bash scripts/gpu_checks.sh prepare | run [tests,ipc,train,logprobs,attention]" >&2
  exit 2
fi
parts=",${2:-tests,ipc,train,logprobs,attention},"
out="${OUT:-/tmp/gpu-checks}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
for p in types losses data sync backends loops; do PYTHONPATH="packages/rollouts-$p/src:${PYTHONPATH:-}"; done
export PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$out/device.txt"

part() {  # part NAME SECONDS COMMAND...: run it if asked for, bounded, its output kept
  local name=$1 seconds=$2
  shift 2
  [[ $parts == *",$name,"* ]] || return 0
  echo "== $name (at most ${seconds} s): $*"
  timeout "$seconds" "$@" 2>&1 | tee "$out/$name.txt"
  echo "== $name: exit ${PIPESTATUS[0]}"
}

part tests 150 python3 -m pytest -q -m cuda -p no:cacheprovider \
  packages/rollouts-losses/tests packages/rollouts-sync/tests packages/rollouts-backends/tests
part ipc 90 python3 benchmarks/bench_ipc.py
part train 240 python3 benchmarks/bench_cuda.py --sections train --steps 3 \
  --variants trl,trl-compile,bf16,bf16-compile,bf16-compile-graphs,fsdp2-bf16,liger
part logprobs 60 python3 benchmarks/bench_cuda.py --sections logprobs --repeats 3 --hidden 3584 \
  --logprob-variants triton,triton-h128
part attention 45 python3 benchmarks/bench_packed_attention.py
