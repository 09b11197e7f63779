"""The overlapped RL loop with the sampler in its own process (ProcessEngine), from Python and from
a run file (`[engine] kind = "process"`): it trains, syncs every step and reaps the process."""

import dataclasses
import json

import numpy as np
import pytest
import trio
from run_configs import child_processes, rl_toml, tiny_rl_config

from rollouts.backends import InProcessEngine, ProcessEngine, build_components, load_hf_model
from rollouts.data import DataBuffer
from rollouts.loops.algorithms import ALGORITHMS
from rollouts.loops.app.cli import main
from rollouts.loops.app.config import ConfigError, RLRun, load_run
from rollouts.loops.app.toml_out import to_toml
from rollouts.loops.engines.coalescing import CoalescingEngine
from rollouts.loops.rl.loop import RunOutputs, run_rl_training
from rollouts.loops.rl.models import RLModels
from rollouts.loops.run.loggers import NullLogger, read_jsonl
from rollouts.types import SamplingParams


def starts_with_seven(sample, record):
    return 1.0 if sample.response.startswith("7") else 0.0


def test_an_overlapped_run_trains_against_an_engine_process(tiny_run_inputs, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_run_inputs / "model"), local_files_only=True)
    model = load_hf_model(tiny_run_inputs / "model")
    records = [json.loads(line) for line in (tiny_run_inputs / "prompts.jsonl").read_text().splitlines()]
    config = dataclasses.replace(
        tiny_rl_config(tokenizer, algorithm=ALGORITHMS["grpo"], steps=3, lr=1e-2, prompts=4, n=4), overlap=True
    )
    components = build_components(model, config.optimizer, num_training_steps=3)
    inner = ProcessEngine(tiny_run_inputs / "model", tokenizer_dir=tiny_run_inputs / "model")
    with inner:
        state, history = run_rl_training(
            RLModels(policy=components, engine=CoalescingEngine(inner, max_prompts_per_call=4)),
            DataBuffer(records, seed=0),
            config,
            reward=starts_with_seven,
            encode_prompt=lambda r: tokenizer.encode(r["prompt"], add_special_tokens=False),
            output=RunOutputs(run_dir=tmp_path, logger=NullLogger(), resume=False),
        )
        assert state.step == 3 and trio.run(inner.weight_version) == state.weight_version == 3
        assert [h["weight_version"] for h in history] == [1.0, 2.0, 3.0]
        assert max(h["staleness_max"] for h in history) <= 1.0  # step n+1 generated while step n trained
        # Synced directly (load_weights through shared memory): nothing exported, no weights written.
        assert all(h["sync_export_s"] == 0.0 for h in history) and not (tmp_path / "weights").exists()
        # The engine process serves exactly the trained weights: the same samples as the trained model.
        params = SamplingParams(n=4, max_new_tokens=5, seed=1)
        prompts = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in records[:3]]
        reference = InProcessEngine(components.model, tokenizer=tokenizer, weight_version=3)
        served, trained = trio.run(inner.generate, prompts, params), trio.run(reference.generate, prompts, params)
        assert [(s.tokens, s.status) for s in served] == [(s.tokens, s.status) for s in trained]
        # Two processes may split a matmul over different thread counts: log-probs agree to float32 rounding.
        for a, b in zip(served, trained, strict=True):
            assert a.rollout_logprobs is not None and b.rollout_logprobs is not None
            assert np.allclose(list(a.rollout_logprobs), list(b.rollout_logprobs), rtol=0, atol=1e-5), (
                a.index,
                b.index,
            )
    assert inner._child.process.returncode == 0 and not child_processes(b"rollouts.backends.engine_process.worker")


def test_rollouts_rl_with_an_engine_process_runs_overlapped_and_reaps_it(tiny_run_inputs, tmp_path):
    rl = rl_toml(tiny_run_inputs, tmp_path / "proc", tiny_run_inputs / "model", extra='[engine]\nkind = "process"')
    assert main(["rl", "--config", str(rl), "--set", "rl.overlap=true"]) == 0
    records = read_jsonl(tmp_path / "proc" / "metrics_rl.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["weight_version"] == 3.0
    assert not child_processes(b"rollouts.backends.engine_process.worker")


def test_the_engine_kind_process_is_validated_and_round_trips(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npath = "/models/tiny"\n[engine]\nkind = "process"\nnum_threads = 2\n')
    run = load_run(RLRun, path, [])
    assert run.engine.kind == "process" and run.engine.num_threads == 2
    (tmp_path / "again.toml").write_text(to_toml(run))
    assert load_run(RLRun, tmp_path / "again.toml", []) == run
    with pytest.raises(
        ConfigError,
        match=r"engine\.kind must be one of 'inprocess', 'process', 'rollout_process', 'vllm', 'sglang', got 'proces'",
    ):
        load_run(RLRun, path, ["engine.kind=proces"])
    with pytest.raises(ConfigError, match=r"EngineSpec\.urls must be empty for kind='process'"):
        load_run(RLRun, path, ['engine.urls=["http://127.0.0.1:8000"]'])
    with pytest.raises(ConfigError, match=r"EngineSpec\.num_threads must be >= 1"):
        load_run(RLRun, path, ["engine.num_threads=0"])
