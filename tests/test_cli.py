"""The `rollouts` command end to end on a tiny local model: SFT, kill-and-resume, RL, config errors."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_configs import rl_toml, sft_toml
from safetensors.numpy import load_file

from rollouts.loops.app.cli import main
from rollouts.loops.run.loggers import read_jsonl

_KILL_WAIT_S = 240  # bound on waiting for the run to reach the checkpoint we kill it after


def _sft_toml(inputs: Path, out: Path, *, steps: int, every: int) -> Path:
    extra = "seed = 3\n[sft.optimizer]\nlr = 3e-3\nwarmup_steps = 2"
    path = out.parent / f"{out.name}.toml"
    return sft_toml(inputs, path, out_dir=out, steps=steps, batch_size=16, every=every, extra=extra)


def _complete_records(path: Path) -> int:
    """Newline-terminated lines in a JSONL file another process is appending to (0 if absent)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def test_sft_loss_decreases(tiny_run_inputs, tmp_path):
    out = tmp_path / "sft"
    assert main(["sft", "--config", str(_sft_toml(tiny_run_inputs, out, steps=30, every=0))]) == 0
    losses = [r["loss"] for r in read_jsonl(out / "metrics_sft.jsonl")]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert (out / "resolved_config.toml").is_file() and (
        out / "checkpoints" / "step_30" / "model.safetensors"
    ).is_file()
    from transformers import AutoModelForCausalLM  # the checkpoint loads as it is

    AutoModelForCausalLM.from_pretrained(str(out / "checkpoints" / "step_30"), local_files_only=True)


def test_kill_and_resume_of_rollouts_sft_is_bit_identical(tiny_run_inputs, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["sft", "--config", str(_sft_toml(tiny_run_inputs, straight, steps=8, every=2))]) == 0
    config = _sft_toml(tiny_run_inputs, resumed, steps=8, every=2)
    command = [sys.executable, "-m", "rollouts.loops.app.cli", "sft", "--config", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # The event: step 5's metrics line, written after step 4's checkpoint was saved. (Not the step_4
    # directory: retention may delete it before a poll sees it.) Whenever the kill lands from then on,
    # the resumed run must end bit-identical.
    deadline = time.monotonic() + _KILL_WAIT_S
    while _complete_records(resumed / "metrics_sft.jsonl") < 5 and process.poll() is None:
        assert time.monotonic() < deadline, "the run never reached step 5"
        time.sleep(0.05)
    assert process.poll() is None or process.returncode == 0, "the run failed before it was killed"
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert subprocess.run(command, env=env, capture_output=True, timeout=_KILL_WAIT_S).returncode == 0
    a = load_file(straight / "checkpoints" / "step_8" / "model.safetensors")
    b = load_file(resumed / "checkpoints" / "step_8" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] == b[name]).all(), f"{name} differs after kill-and-resume"


def test_config_errors_name_the_key_before_work(tiny_run_inputs, tmp_path, capsys):
    config = _sft_toml(tiny_run_inputs, tmp_path / "bad", steps=2, every=0)
    assert main(["sft", "--config", str(config), "--set", "sft.optimizer.learning_rate=0.1"]) == 2
    err = capsys.readouterr().err
    assert "bad.toml" in err and "unknown key(s) ['learning_rate']" in err and "allowed keys" in err and "'lr'" in err
    assert main(["sft", "--config", str(config), "--set", "sft.loss_aggregation='mean'"]) == 2
    assert "loss_aggregation must be one of 'token-mean'" in capsys.readouterr().err
    assert main(["sft", "--config", str(config), "--set", "data.train_path='/nope.jsonl'"]) == 2
    assert "data.train_path '/nope.jsonl'" in capsys.readouterr().err
    assert not (tmp_path / "bad" / "checkpoints").exists()  # nothing ran


def test_pipeline_checks_the_rl_files_before_sft_runs(tiny_run_inputs, tmp_path, capsys):
    sft = _sft_toml(tiny_run_inputs, tmp_path / "p_sft", steps=4, every=0)
    rl = rl_toml(tiny_run_inputs, tmp_path / "p_rl", tmp_path / "not-yet-written")  # model.path: SFT's output
    assert (
        main(
            ["pipeline", "--sft-config", str(sft), "--rl-config", str(rl), "--set-rl", "data.train_path='/nope.jsonl'"]
        )
        == 2
    )
    assert "data.train_path '/nope.jsonl'" in capsys.readouterr().err
    assert not (tmp_path / "p_sft").exists()  # SFT never started


def test_pipeline_runs_sft_then_rl_from_its_checkpoint(tiny_run_inputs, tmp_path):
    sft = _sft_toml(tiny_run_inputs, tmp_path / "p_sft", steps=4, every=0)
    rl = rl_toml(tiny_run_inputs, tmp_path / "p_rl", tiny_run_inputs / "model")
    assert main(["pipeline", "--sft-config", str(sft), "--rl-config", str(rl)]) == 0
    records = read_jsonl(tmp_path / "p_rl" / "metrics_rl.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["weight_version"] == 3.0
    resolved = json.loads((tmp_path / "p_rl" / "resolved_config.json").read_text())
    assert resolved["model"]["path"].endswith("step_4")
    assert main(["plot", str(tmp_path / "p_rl")]) == 0 and (tmp_path / "p_rl" / "metrics.png").stat().st_size > 0


def test_rl_overlap_mode_records_staleness(tiny_run_inputs, tmp_path):
    rl = rl_toml(tiny_run_inputs, tmp_path / "overlap", tiny_run_inputs / "model")
    assert main(["rl", "--config", str(rl), "--set", "rl.overlap=true"]) == 0
    records = read_jsonl(tmp_path / "overlap" / "metrics_rl.jsonl")
    assert len(records) == 3 and max(r["staleness_max"] for r in records) <= 1.0
    assert records[-1]["weight_version"] == 3.0


@pytest.mark.slow
def test_rollouts_sft_under_torchrun_uses_fsdp2(tiny_run_inputs, tmp_path):
    out = tmp_path / "fsdp"
    config = _sft_toml(tiny_run_inputs, out, steps=3, every=0)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "-m",
        "rollouts.loops.app.cli",
        "sft",
        "--config",
        str(config),
        # 7 samples over 2 ranks in micro-batches of ~3: the ranks run different numbers of
        # micro-batches, which FSDP's collectives must survive
        "--set",
        "sft.batch_size=7",
        "--set",
        "sft.max_tokens_per_micro_batch=32",
    ]
    done = subprocess.run(
        command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=_KILL_WAIT_S
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_jsonl(out / "metrics_sft.jsonl")  # rank 0 logs; every rank trained its half
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["num_loss_tokens"] <= 4 * 4 for r in records)  # rank 0's share: 4 of 7 samples
    weights = load_file(out / "checkpoints" / "step_3" / "model.safetensors")
    assert weights and all(v.size > 0 for v in weights.values())  # gathered full tensors, not shards
    optimizer_files = sorted(p.name for p in (out / "checkpoints" / "step_3").glob("optimizer*"))
    assert optimizer_files == [f"optimizer-rank{r:05d}-of-00002.safetensors" for r in range(2)]  # one per rank


@pytest.mark.slow
# ppo: KL in the loss (a sharded reference on every rank) and a sharded critic; the other presets'
# losses under two ranks are tests/test_rl_data_parallel.py's
@pytest.mark.parametrize("preset", ["grpo", "ppo"])
def test_rollouts_rl_under_torchrun(tiny_run_inputs, tmp_path, preset):
    out = tmp_path / "rl_fsdp"
    config = rl_toml(tiny_run_inputs, out, tiny_run_inputs / "model")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "-m",
        "rollouts.loops.app.cli",
        "rl",
        "--config",
        str(config),
        "--set",
        f"preset={preset}",
        "--set",
        "rl.checkpoint.every_steps=2",
        "--set",
        "rl.rollout.batch_size=3",
    ]
    if preset == "ppo":  # several micro-batches per step, each layer gathered once per step (policy and critic)
        command += ["--set", "model.gather_once_per_step=true", "--set", "rl.max_tokens_per_micro_batch=64"]
    done = subprocess.run(
        command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=_KILL_WAIT_S
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_jsonl(out / "metrics_rl.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["weight_version"] for r in records] == [1.0, 2.0, 3.0]
    assert all(("kl" in r) == (preset != "grpo") for r in records)  # the KL against the (sharded) reference
    assert all(("vf_loss" in r) == (preset == "ppo") for r in records)  # the critic's update
    if preset == "ppo":
        assert (out / "checkpoints" / "critic" / "step_3" / "state.json").is_file()
        assert all(r["num_micro_batches"] > 1 for r in records), [r["num_micro_batches"] for r in records]
    weights = load_file(out / "checkpoints" / "step_3" / "model.safetensors")
    assert weights and all(v.size > 0 for v in weights.values())
    assert (out / "checkpoints" / "step_2" / "state.json").is_file()
