#!/usr/bin/env bash
# Run the tests most exposed to timing and teardown N times: the slow tests (torchrun/FSDP2 on gloo,
# SIGKILL-and-resume of checkpoints, fault injection) and the kill/resume and torchrun tests of the
# CLI. Then once more under a CPU hog (two busy processes on this machine's cores). Prints the pass
# count. Not part of CI: run it before trusting a change to those paths.
#
#   bash scripts/stress_tests.sh 20            # 20 rounds + 1 under load
#   STRESS_HOG_ROUNDS=5 bash scripts/stress_tests.sh 20   # 20 rounds + 5 under load
set -u
cd "$(dirname "$0")/.."
export PATH="$HOME/.local/bin:$PATH"
rounds="${1:?usage: scripts/stress_tests.sh N}"
hog_rounds="${STRESS_HOG_ROUNDS:-1}"
log_dir="${STRESS_LOG_DIR:-$(mktemp -d -t rollouts-stress-XXXX)}"
mkdir -p "$log_dir"
selection=(-m "not vllm" -k "slow or kill or resume or torchrun or fsdp or sigkill")
# -m selects by marker; the -k words catch the unmarked kill/resume tests. Marker "slow" is matched
# through -k too (pytest's -k matches marker names).

run_round() {  # $1: label; prints one line, returns pytest's status
    local label="$1" log="$log_dir/$1.log" start=$SECONDS rc=0
    uv run --locked pytest -q -p no:cacheprovider "${selection[@]}" packages tests >"$log" 2>&1 || rc=$?
    printf '%-10s %s  %3ds  load %s  %s\n' "$label" "$([ $rc -eq 0 ] && echo pass || echo FAIL)" \
        $((SECONDS - start)) "$(cut -d' ' -f1-3 /proc/loadavg)" "$(tail -n 1 "$log")"
    return $rc
}

passed=0 total=0
for i in $(seq 1 "$rounds"); do
    total=$((total + 1)); run_round "round-$i" && passed=$((passed + 1))
done
hogs=()
for _ in $(seq 1 "$(nproc)"); do (while :; do :; done) & hogs+=($!); done
trap 'kill "${hogs[@]}" 2>/dev/null' EXIT
for i in $(seq 1 "$hog_rounds"); do
    total=$((total + 1)); run_round "hog-$i" && passed=$((passed + 1))
done
kill "${hogs[@]}" 2>/dev/null
echo "stress: $passed/$total rounds passed (logs in $log_dir)"
[ "$passed" -eq "$total" ]
