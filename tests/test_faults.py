"""Faults reach the user as errors that name their cause, before they reach torch."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path

import pytest

from rollouts.backends import InProcessEngine, build_components, load_hf_model
from rollouts.data import DataBuffer
from rollouts.loops.rl.loop import RLHooks, RunOutputs, run_rl_training
from rollouts.loops.rl.models import RLModels
from rollouts.loops.rollouts.functions import single_turn_rollout
from rollouts.loops.run.loggers import NullLogger
from rollouts.types import CheckpointConfig, OptimizerConfig, RLConfig, RolloutConfig, SamplingParams


class OtherVocabularyEngine:
    """An engine serving a model with a larger vocabulary: its samples carry ids the trainer lacks."""

    name = "http://engine-b:8000"

    def __init__(self, inner, extra_id):
        self.inner, self.extra_id = inner, extra_id

    async def generate(self, prompts, params):
        samples = await self.inner.generate(prompts, params)
        return [dataclasses.replace(s, tokens=(*s.tokens[:-1], self.extra_id)) for s in samples]

    async def update_weights_from_disk(self, path, weight_version):
        await self.inner.update_weights_from_disk(path, weight_version)

    async def weight_version(self):
        return await self.inner.weight_version()

    async def health(self):
        return True


def test_token_ids_outside_the_vocabulary_are_an_error_naming_the_engine(tiny_run_inputs, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_run_inputs / "model"), local_files_only=True)
    model = load_hf_model(tiny_run_inputs / "model")
    vocab = model.get_input_embeddings().num_embeddings
    config = RLConfig(
        num_steps=2,
        rollout=RolloutConfig(
            batch_size=2, samples_per_prompt=2, max_retries=0, sampling=SamplingParams(max_new_tokens=3)
        ),
        optimizer=OptimizerConfig(lr=1e-3),
        checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
        max_tokens_per_micro_batch=256,
    )
    engine = OtherVocabularyEngine(InProcessEngine(model, tokenizer=tokenizer), extra_id=vocab + 5)
    records = [{"prompt": "12+34=", "answer": "64"}, {"prompt": "50+50=", "answer": "001"}]
    with pytest.raises(RuntimeError) as caught:
        run_rl_training(
            RLModels(
                policy=build_components(model, config.optimizer, num_training_steps=2),
                engine=engine,
                engine_shares_model=True,
            ),
            DataBuffer(records),
            config,
            reward=lambda s, r: 1.0,
            encode_prompt=lambda r: tokenizer.encode(r["prompt"], add_special_tokens=False),
            output=RunOutputs(run_dir=tmp_path, logger=NullLogger(), resume=False),
        )
    message = str(caught.value)
    assert "engine-b" in message and f"token id {vocab + 5}" in message and f"vocabulary of {vocab}" in message


def test_one_prompt_too_long_for_a_micro_batch_fails_only_its_group_and_says_why(tiny_run_inputs, tmp_path):
    from transformers import AutoTokenizer

    from rollouts.loops.engines.coalescing import CoalescingEngine

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_run_inputs / "model"), local_files_only=True)
    model = load_hf_model(tiny_run_inputs / "model")
    budget = 24
    config = RLConfig(
        num_steps=1,
        rollout=RolloutConfig(
            batch_size=3,
            samples_per_prompt=2,
            max_retries=0,
            max_concurrency=3,
            sampling=SamplingParams(max_new_tokens=3),
        ),
        optimizer=OptimizerConfig(lr=1e-3),
        checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
        max_tokens_per_micro_batch=budget,
    )
    records = [
        {"prompt": "12+34=", "answer": "64"},
        {"prompt": "1+2+3+4+5+6+7+8+9+10+11+12=", "answer": "87"},
        {"prompt": "50+50=", "answer": "001"},
    ]
    engine = CoalescingEngine(InProcessEngine(model, tokenizer=tokenizer), max_prompts_per_call=8)
    state, history = run_rl_training(
        RLModels(
            policy=build_components(model, config.optimizer, num_training_steps=1),
            engine=engine,
            engine_shares_model=True,
        ),
        DataBuffer(records, shuffle=False),
        config,
        reward=lambda s, r: float(len(s.response) > 0),
        encode_prompt=lambda r: tokenizer.encode(r["prompt"], add_special_tokens=False),
        output=RunOutputs(run_dir=tmp_path, logger=NullLogger(), resume=False),
        # A rollout function of the user's own (say, multi-turn: its samples can outgrow the first
        # prompt), so the check before the run does not apply and the group fails when generated.
        hooks=RLHooks(rollout=lambda record, ctx: single_turn_rollout(record, ctx)),
    )
    (metrics,) = history
    assert state.step == 1 and metrics["num_trained"] == 4  # the two short prompts' groups
    assert f"rl.max_tokens_per_micro_batch={budget}" in metrics["failure_causes"]


def test_prompts_too_long_for_the_model_or_a_micro_batch_are_refused_before_the_run(tiny_run_inputs, tmp_path):
    """Found where the data enters (all of them, counted and named), not when a prompt's turn
    comes mid-run."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_run_inputs / "model"), local_files_only=True)
    model = load_hf_model(tiny_run_inputs / "model")
    context = model.config.max_position_embeddings
    records = [{"prompt": "1+1="}, {"prompt": "1+" * context + "1="}, {"prompt": "2+2="}, {"prompt": "9+" * 20 + "="}]

    def run(max_new_tokens, budget):
        config = RLConfig(
            num_steps=1,
            rollout=RolloutConfig(
                batch_size=2, samples_per_prompt=2, sampling=SamplingParams(max_new_tokens=max_new_tokens)
            ),
            checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
            max_tokens_per_micro_batch=budget,
        )
        return run_rl_training(
            RLModels(
                policy=build_components(model, config.optimizer, num_training_steps=1),
                engine=InProcessEngine(model, tokenizer=tokenizer),
                engine_shares_model=True,
            ),
            DataBuffer(records, shuffle=False),
            config,
            reward=lambda s, r: 1.0,
            encode_prompt=lambda r: tokenizer.encode(r["prompt"], add_special_tokens=False),
            output=RunOutputs(run_dir=tmp_path, logger=NullLogger(), resume=False),
        )

    with pytest.raises(ValueError) as caught:
        run(4, 4096)
    message = str(caught.value)
    assert "1 of 4 prompts cannot fit with rollout.sampling.max_new_tokens=4" in message
    assert "record 1 (" in message and f"max_position_embeddings={context}" in message
    long_one = len(tokenizer.encode(records[3]["prompt"], add_special_tokens=False))
    with pytest.raises(ValueError, match=r"2 of 4 prompts .*record 3 .*rl.max_tokens_per_micro_batch="):
        run(4, long_one + 3)
    assert not (tmp_path / "checkpoints").exists()  # refused before any work


@contextlib.contextmanager
def _fake_vllm_in_a_thread(state):
    """The fake vLLM server on its own event loop in a thread, for a loop that runs trio.run itself."""
    import threading

    import trio

    from rollouts.sync.fake_server import serve_fake_engine

    ready, stop, box = threading.Event(), threading.Event(), {}

    async def serve():
        async with serve_fake_engine(state) as server:
            box["url"] = server.url
            ready.set()
            while not stop.is_set():
                await trio.sleep(0.01)

    thread = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    thread.start()
    assert ready.wait(timeout=30), "the fake engine did not start"
    try:
        yield box["url"]
    finally:
        stop.set()
        thread.join(timeout=30)


@pytest.mark.parametrize("fault", ["status", "hang"])
def test_engine_failures_reach_the_user_with_engine_url_status_and_message(tiny_run_inputs, tmp_path, fault):
    """An engine answering HTTP 500, or never answering, ended as 'N steps in a row produced no
    trainable sample (failed: 16)' with no URL, status or cause."""
    from rollouts.sync import HTTPOptions, RetryPolicy, VLLMEngine
    from rollouts.sync.fake_server import FakeEngineState, Fault

    model = load_hf_model(tiny_run_inputs / "model")
    state = FakeEngineState(vocab_size=model.config.vocab_size)
    if fault == "status":
        state.faults.append(Fault(kind="status", path="/v1/completions", times=10_000, status=500, text="CUDA OOM"))
    else:
        state.faults.append(Fault(kind="delay", path="/v1/completions", times=10_000, delay_s=3600.0))
    config = RLConfig(
        num_steps=8,
        rollout=RolloutConfig(
            batch_size=2,
            samples_per_prompt=2,
            max_retries=0,
            request_timeout_s=0.5,
            sampling=SamplingParams(max_new_tokens=2),
        ),
        checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
    )
    with _fake_vllm_in_a_thread(state) as url:
        engine = VLLMEngine(url, http=HTTPOptions(timeout_s=30.0, retry=RetryPolicy(max_retries=0)))
        with pytest.raises(RuntimeError, match="steps in a row produced no trainable sample") as caught:
            run_rl_training(
                RLModels(policy=build_components(model, config.optimizer, num_training_steps=8), engine=engine),
                DataBuffer([{"prompt": "1+1="}, {"prompt": "2+2="}], shuffle=False),
                config,
                reward=lambda s, r: 1.0,
                encode_prompt=lambda r: [5, 6, 7],
                output=RunOutputs(run_dir=tmp_path, logger=NullLogger(), resume=False),
            )
    message = str(caught.value)
    assert url in message, message
    if fault == "status":
        assert "500" in message and "CUDA OOM" in message, message
    else:
        assert "timed out after 0.5 s waiting for " + url in message, message


def test_an_rl_record_without_its_answer_is_refused_at_load_time_naming_file_and_line(
    tiny_run_inputs, tmp_path, capsys
):
    """Found only mid-run when the reward ran (and a rerun skipped the prompts drawn with it)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from run_configs import rl_toml

    from rollouts.loops.app.cli import main

    lines = (tiny_run_inputs / "prompts.jsonl").read_text().splitlines()
    lines[5] = '{"prompt": "1+1="}'
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(lines) + "\n")
    config = rl_toml(tiny_run_inputs, tmp_path / "run", tiny_run_inputs / "model")
    assert main(["rl", "--config", str(config), "--set", f"data.train_path={str(data)!r}"]) != 0
    err = capsys.readouterr().err
    assert f"{data}:6" in err and "answer" in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("on_error", ["raise", "zero"])
@pytest.mark.parametrize("fails", ["every call", "every other call"])
def test_a_failing_reward_functions_message_reaches_the_error_and_the_jsonl(
    tiny_run_inputs, tmp_path, capsys, on_error, fails
):
    """A reward given by file path that raises: its exception type and message are in the run's error
    (on_error = "raise", or any policy once every reward of a step failed) or in each step's JSONL
    failure_causes (on_error = "zero")."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from run_configs import rl_toml

    from rollouts.loops import read_jsonl
    from rollouts.loops.app.cli import main

    rewards = tmp_path / "my_rewards.py"
    every = fails == "every call"
    rewards.write_text(
        "import itertools\n"
        "_calls = itertools.count()\n"
        "def strict(sample, record):\n"
        f"    if {every} or next(_calls) % 2:\n"
        "        raise KeyError(f'no field named score in {sorted(record)}')\n"
        "    return 1.0\n"
    )
    config = rl_toml(
        tiny_run_inputs,
        tmp_path / "run",
        tiny_run_inputs / "model",
        extra=f'[reward]\nfn = "{rewards}:strict"\non_error = "{on_error}"\n',
    )
    text = config.read_text().replace('[reward]\nfn = "exact_match"\n', "")
    config.write_text(text)
    args = ["rl", "--config", str(config), "--set", "rl.num_steps=2"]
    if on_error == "raise" or every:
        count = "16 of 16" if every else "8 of 16"
        assert main(args) == 1  # one paragraph on the screen, the traceback in the run's error.log
        err = capsys.readouterr().err
        assert re.search(
            rf"rollouts rl failed: RewardError: {count} rewards failed; first: .KeyError: .no field named score", err
        )
    else:
        assert main(args) == 0, capsys.readouterr().err
        records = read_jsonl(tmp_path / "run" / "metrics_rl.jsonl")
        assert records and all("no field named score" in r["failure_causes"] for r in records), records
