#!/usr/bin/env bash
# The project's GPU checks in bounded parts, for a CUDA machine with no network (python3 there holds
# torch, transformers, triton, hypothesis, httpx, anyio, safetensors, peft, pytest; no uv):
#   bash scripts/gpu_checks.sh prepare      # here, with network: the wheels it lacks, into .whl/
#   bash scripts/gpu_checks.sh run [PARTS]  # there, from the repository root, with .whl/ carried
# .whl/ is git-excluded: the device call must carry it (carry: [".whl"]); without it the run stops.
# PARTS (comma-separated): tests (the CUDA tests, and the Triton log-prob tests on the GPU), ipc
# (benchmarks/bench_ipc.py), attention (bench_packed_attention.py), train (bench_cuda's train
# section: ours beside trl-compile, FSDP2 gathered once per step, CUDA graphs), logprobs (bench_cuda's
# log-prob kernels at H=3584). One device call runs at most 600 s, so run them in two calls:
#   run tests,ipc,attention   (at most about 400 s)
#   run train,logprobs        (at most about 400 s)
# Each part has a time bound (SIGINT first, so pytest prints its summary and a benchmark its
# traceback); its output and exit status go to $OUT/<part>.txt where $OUT is set, else /tmp/gpu-checks.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=(trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 liger-kernel==0.8.5)

if [ "${1:-}" = "prepare" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
  rm -rf .whl
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}"
  ls .whl
  exit
fi
if [ "${1:-}" != "run" ]; then
  echo "usage: bash scripts/gpu_checks.sh prepare | run [tests,ipc,attention,train,logprobs]" >&2
  exit 2
fi
parts=",${2:-tests,ipc,attention},"
out="${OUT:-/tmp/gpu-checks}"
mkdir -p "$out"
if ! compgen -G ".whl/*.whl" >/dev/null; then
  echo "no wheels in .whl/: run 'bash scripts/gpu_checks.sh prepare' here and carry .whl to the device" | tee "$out/device.txt" >&2
  exit 2
fi
if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >"$out/pip.txt" 2>&1; then
  echo "installing .whl/ failed: see pip.txt" | tee -a "$out/device.txt" >&2
  exit 1
fi
PYTHONPATH=/tmp/site
for p in types losses data sync backends loops; do PYTHONPATH="packages/rollouts-$p/src:$PYTHONPATH"; done
export PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$out/device.txt"
python3 - 2>&1 <<'EOF' | tee -a "$out/device.txt"
import importlib.metadata as m
names = ["torch", "triton", "transformers", "anyio", "trio", "httpx", "safetensors", "peft", "hypothesis", "pytest",
         "liger-kernel", "numpy"]
for name in names:
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "missing")
EOF

part() {  # part NAME SECONDS COMMAND...: run it if asked for, bounded, its output and exit status kept
  local name=$1 seconds=$2
  shift 2
  [[ $parts == *",$name,"* ]] || return 0
  echo "== $name (at most ${seconds} s): $*" | tee -a "$out/$name.txt"
  timeout -s INT -k 15 "$seconds" "$@" 2>&1 | tee -a "$out/$name.txt"
  echo "== $name: exit ${PIPESTATUS[0]}" | tee -a "$out/$name.txt"
}

PYTEST=(python3 -m pytest -q -rfEs --durations=10 -o faulthandler_timeout=60 -p no:cacheprovider
        --continue-on-collection-errors)
part tests 150 "${PYTEST[@]}" -m cuda \
  packages/rollouts-losses/tests/test_logprobs.py packages/rollouts-losses/tests/test_triton_logprobs.py \
  packages/rollouts-sync/tests/test_ipc.py packages/rollouts-backends/tests/test_cuda_ipc.py \
  packages/rollouts-backends/tests/test_train.py packages/rollouts-backends/tests/test_train_speed.py \
  packages/rollouts-backends/tests/test_checkpoint.py tests/test_fingerprint_torch.py
part tests 90 "${PYTEST[@]}" packages/rollouts-losses/tests/test_triton_logprobs.py  # the kernels on the GPU
part ipc 150 python3 benchmarks/bench_ipc.py
part attention 90 python3 benchmarks/bench_packed_attention.py --repeats 3
# trl-compile and bf16-compile were measured on an H100 (2026-11-27); the ratio needs both in one run.
part train 300 python3 benchmarks/bench_cuda.py --sections train --steps 3 --variant-timeout 90 \
  --variants trl-compile,bf16-compile,fsdp2-bf16-gathered,bf16-compile-graphs
part logprobs 90 python3 benchmarks/bench_cuda.py --sections logprobs --repeats 3 --hidden 3584 \
  --logprob-variants triton,triton-h128
