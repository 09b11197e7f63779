"""RolloutProcess: the rollout manager in the engine process. A seeded overlapped run through it
trains exactly as one whose manager runs in the trainer (ProcessEngine), resumes as if never
stopped, reaps its process, and refuses what it cannot run before any work."""

import dataclasses
import json

import pytest
from run_configs import child_processes, rl_toml, tiny_rl_config

from rollouts.backends import ProcessEngine, build_components, load_hf_model
from rollouts.data import DataBuffer, prompt_encoder
from rollouts.loops.algorithms import ALGORITHMS
from rollouts.loops.app.cli import main
from rollouts.loops.engines.coalescing import CoalescingEngine
from rollouts.loops.engines.rollout_process import RolloutProcess
from rollouts.loops.plugins import PluginError
from rollouts.loops.rl.loop import RunOutputs, run_rl_training
from rollouts.loops.rl.models import RLModels
from rollouts.loops.run.loggers import NullLogger, read_jsonl
from rollouts.types import CheckpointConfig


def starts_with_seven(sample, record):
    """Imported by name in the rollout process (from this file, through the trainer's sys.path)."""
    return 1.0 if sample.response.startswith("7") else 0.0


def _inputs(tiny_run_inputs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_run_inputs / "model"), local_files_only=True)
    records = [json.loads(line) for line in (tiny_run_inputs / "prompts.jsonl").read_text().splitlines()]
    return tokenizer, records


class _Crash(Exception):
    pass


def _crash_at(step):
    def on_step(state, metrics):
        if state.step == step:
            raise _Crash

    return on_step


def _run(tiny_run_inputs, run_dir, *, rollout_process: bool, steps: int, resume=False, on_step=None):
    """`steps` of a seeded overlapped GRPO run (checkpoint every 2 steps), with the rollout manager in
    the engine process or in this one; the per-step metrics, timings left out."""
    tokenizer, records = _inputs(tiny_run_inputs)
    config = tiny_rl_config(tokenizer, algorithm=ALGORITHMS["grpo"], steps=steps, lr=1e-2, prompts=4, n=4, seed=5)
    config = dataclasses.replace(
        config, overlap=True, checkpoint=CheckpointConfig(every_steps=2, keep_last=2, save_optimizer=True)
    )
    components = build_components(load_hf_model(tiny_run_inputs / "model"), config.optimizer, num_training_steps=steps)
    model_dir = tiny_run_inputs / "model"
    if rollout_process:
        inner = RolloutProcess(model_dir, tokenizer_dir=model_dir, max_prompts_per_call=4)
        engine = inner
    else:
        inner = ProcessEngine(model_dir, tokenizer_dir=model_dir)
        engine = CoalescingEngine(inner, max_prompts_per_call=4)
    with inner:
        _, history = run_rl_training(
            RLModels(policy=components, engine=engine),
            DataBuffer(records, seed=0),
            config,
            reward=starts_with_seven,
            encode_prompt=prompt_encoder(tokenizer, chat=False),
            output=RunOutputs(run_dir=run_dir, logger=NullLogger(), resume=resume, on_step=on_step),
        )
    return [{k: v for k, v in h.items() if not k.endswith("_s")} for h in history]


@pytest.fixture(scope="module")
def straight(tiny_run_inputs, tmp_path_factory):
    """4 uninterrupted steps through a RolloutProcess: what the other runs are compared with."""
    return _run(tiny_run_inputs, tmp_path_factory.mktemp("straight"), rollout_process=True, steps=4)


def test_a_run_with_its_rollouts_in_the_engine_process_trains_as_one_without(tiny_run_inputs, tmp_path, straight):
    here = _run(tiny_run_inputs, tmp_path / "here", rollout_process=False, steps=4)
    there = straight
    assert len(there) == 4 and there == here  # same samples, rewards, losses: the same manager, elsewhere
    assert max(h["staleness_max"] for h in there) <= 1.0  # generated one step ahead
    assert not child_processes(b"rollouts.loops.engines.rollout_worker")  # reaped


def test_a_run_with_its_rollouts_in_the_engine_process_resumes_as_if_never_stopped(tiny_run_inputs, tmp_path, straight):
    with pytest.raises(_Crash):  # after step 3, so the last checkpoint is step 2's
        _run(tiny_run_inputs, tmp_path / "stopped", rollout_process=True, steps=4, on_step=_crash_at(3))
    # The checkpoint at step 2 holds the batch generated ahead and the remote buffer and manager after it.
    rest = _run(tiny_run_inputs, tmp_path / "stopped", rollout_process=True, steps=4, resume=True)
    assert rest == straight[2:]
    assert not child_processes(b"rollouts.loops.engines.rollout_worker")


def test_rollouts_rl_with_a_rollout_process_trains_overlapped_and_reaps_it(tiny_run_inputs, tmp_path):
    extra = '[engine]\nkind = "rollout_process"'
    rl = rl_toml(tiny_run_inputs, tmp_path / "proc", tiny_run_inputs / "model", extra=extra)
    assert main(["rl", "--config", str(rl), "--set", "rl.overlap=true"]) == 0
    records = read_jsonl(tmp_path / "proc" / "metrics_rl.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["weight_version"] == 3.0
    assert all(r["num_trained"] == r["num_samples"] > 0 for r in records)
    assert not child_processes(b"rollouts.loops.engines.rollout_worker")


def _refused(tiny_run_inputs, engine, run_dir, **changes):
    tokenizer, records = _inputs(tiny_run_inputs)
    config = tiny_rl_config(tokenizer, algorithm=ALGORITHMS["grpo"], steps=1, lr=1e-2, prompts=2, n=2)
    if "rollout" in changes:
        rollout = dataclasses.replace(config.rollout, **changes.pop("rollout"))
        config = dataclasses.replace(config, rollout=rollout, overlap=True)
    kwargs = {
        "reward": starts_with_seven,
        "encode_prompt": prompt_encoder(tokenizer, chat=False),
        "buffer": DataBuffer(records, seed=0),
    } | changes
    run_rl_training(
        RLModels(
            policy=build_components(load_hf_model(tiny_run_inputs / "model"), config.optimizer, num_training_steps=1),
            engine=engine,
        ),
        kwargs.pop("buffer"),
        config,
        output=RunOutputs(run_dir=run_dir, logger=NullLogger(), resume=False),
        **kwargs,
    )


def test_what_a_rollout_process_cannot_run_is_refused_naming_it(tiny_run_inputs, tmp_path):
    tokenizer, records = _inputs(tiny_run_inputs)
    model_dir = tiny_run_inputs / "model"
    with RolloutProcess(model_dir, tokenizer_dir=model_dir) as engine:  # refused before it is configured
        with pytest.raises(PluginError, match="reward: .* has no import path"):
            _refused(tiny_run_inputs, engine, tmp_path / "a", reward=lambda sample, record: 0.0)
        with pytest.raises(PluginError, match="encode_prompt: .* has no import path"):
            _refused(tiny_run_inputs, engine, tmp_path / "b", encode_prompt=lambda r: tokenizer.encode(r["prompt"]))
        with pytest.raises(ValueError, match="prompt record 1 is not JSON"):
            bad = DataBuffer([records[0], {"prompt": "1+2=", "x": {1, 2}}])
            _refused(tiny_run_inputs, engine, tmp_path / "c", buffer=bad)
        with pytest.raises(ValueError, match="does not take rl.rollout.partial"):
            _refused(tiny_run_inputs, engine, tmp_path / "d", rollout={"partial": True})
        with pytest.raises(RuntimeError, match="no rollout manager yet"):
            engine.generate_batch_blocking(0, 0)
    assert not child_processes(b"rollouts.loops.engines.rollout_worker")


def test_rollouts_rl_refuses_what_cannot_cross_before_any_work(tiny_run_inputs, tmp_path, capsys):
    extra = '[engine]\nkind = "rollout_process"'
    rl = rl_toml(tiny_run_inputs, tmp_path / "partial", tiny_run_inputs / "model", extra=extra)
    assert main(["rl", "--config", str(rl), "--set", "rl.overlap=true", "--set", "rl.rollout.partial=true"]) == 2
    assert (
        "engine.kind = 'rollout_process': a RolloutProcess does not take rl.rollout.partial" in capsys.readouterr().err
    )
    assert not (tmp_path / "partial").exists()  # refused before the run directory, the model or the engine
    assert not child_processes(b"rollouts.loops.engines.rollout_worker")


def test_a_killed_rollout_process_is_one_paragraph_naming_the_signal_and_the_resume(tiny_run_inputs, tmp_path, capsys):
    # The reward runs in the rollout process: this one kills that process at its first call.
    plugin = tmp_path / "fatal_reward.py"
    plugin.write_text("import os, signal\ndef reward(sample, record):\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    rl = rl_toml(
        tiny_run_inputs, tmp_path / "killed", tiny_run_inputs / "model", extra='[engine]\nkind = "rollout_process"'
    )
    rl.write_text(rl.read_text().replace('fn = "exact_match"', f'fn = "{plugin}:reward"'))
    assert main(["rl", "--config", str(rl)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "killed by SIGKILL (exit code -9)" in err and "rollouts rl failed: EngineProcessError" in err
    assert f"--set run.out_dir='{tmp_path / 'killed'}'" in err  # how to resume (or run again)
    assert not child_processes(b"rollouts.loops.engines.rollout_worker")
