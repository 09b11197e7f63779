"""Every example run file in examples/ loads, validates, and runs for a step or two on a tiny local
model (paths and sizes overridden with --set, as a user would); the vLLM one is loaded and validated
(tests/test_rl_vllm.py runs that path against a real server); the judge one asks the fake server's
scripted chat."""

import threading
import tomllib
from pathlib import Path

import pytest

from rollouts.loops.app.cli import main
from rollouts.loops.app.config import RLRun, SFTRun, load_run
from rollouts.loops.app.dpo_run import DPORun
from rollouts.loops.run.loggers import read_jsonl
from rollouts.sync.fake_server import serve_fake_engine

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TOMLS = sorted(p.name for p in EXAMPLES.glob("*.toml"))
SMALL_RL = [
    "rl.num_steps=2",
    "rl.max_tokens_per_micro_batch=1024",
    "rl.rollout.batch_size=2",
    "rl.rollout.samples_per_prompt=2",
    "rl.rollout.max_concurrency=4",
    "rl.rollout.sampling.max_new_tokens=4",
    "model.dtype='float32'",
    "model.device='cpu'",
]


def test_the_examples_cover_what_users_start_from():
    assert {"sft_chat.toml", "grpo_inprocess.toml", "grpo_vllm.toml", "dapo.toml", "tool_use.toml"} <= set(TOMLS)
    for name in TOMLS:  # every key is commented somewhere in the file: they are documents too
        text = (EXAMPLES / name).read_text()
        assert text.lstrip().startswith("#") and "rollouts " in text.split("\n\n")[0], name


@pytest.mark.parametrize("name", TOMLS)
def test_every_example_loads_and_validates(name):
    kind = SFTRun if "sft" in name else DPORun if "dpo" in name else RLRun
    run = load_run(kind, str(EXAMPLES / name))
    assert run.model.path  # a document of a real run, not an empty template
    tomllib.loads((EXAMPLES / name).read_text())


@pytest.fixture
def fake_judge_url():
    """The fake server (scripted chat: "Score: N") running in a thread of its own for the test."""
    import trio

    ready, done, url = threading.Event(), trio.Event(), []

    async def serve():
        async with serve_fake_engine() as server:
            url.append(server.url)
            ready.set()
            with trio.move_on_after(600):  # bounded: a test that never finishes leaves no server behind
                await done.wait()

    token: list = []

    def run():
        async def main():
            token.append(trio.lowlevel.current_trio_token())
            await serve()

        trio.run(main)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30)
    yield url[0]
    trio.from_thread.run_sync(done.set, trio_token=token[0])
    thread.join(30)


@pytest.mark.parametrize("name", [n for n in TOMLS if n != "grpo_vllm.toml"])
def test_every_example_runs_a_step_or_two(name, tiny_run_inputs, tmp_path, monkeypatch, request):
    monkeypatch.chdir(EXAMPLES.parent)  # the tool example names its rollout by a repository path
    out = tmp_path / "run"
    common = [f"model.path='{tiny_run_inputs / 'model'}'", f"run.out_dir='{out}'"]
    if "sft" in name:
        sets = [
            *common,
            f"data.train_path='{tiny_run_inputs / 'sft.jsonl'}'",
            "sft.num_steps=2",
            "sft.batch_size=4",
            "sft.max_length=32",
            "sft.max_tokens_per_micro_batch=256",
            "model.dtype='float32'",
            "model.device='cpu'",
            "model.gradient_checkpointing=false",
        ]
        command, metrics = "sft", "metrics_sft.jsonl"
    elif "dpo" in name:  # its own tiny data: addition pairs the tiny model's tokenizer spells
        sets = [
            *common,
            "dpo.num_steps=2",
            "dpo.batch_size=4",
            "dpo.max_length=32",
            "dpo.max_tokens_per_micro_batch=256",
            "model.dtype='float32'",
            "model.device='cpu'",
        ]
        command, metrics = "dpo", "metrics_dpo.jsonl"
    else:
        sets = [*common, f"data.train_path='{tiny_run_inputs / 'prompts.jsonl'}'", *SMALL_RL]
        if name == "dapo.toml":  # dynamic sampling drops groups whose rewards agree: give them a spread
            reward = tmp_path / "spread.py"
            reward.write_text("def spread(sample, record):\n    return float(sum(sample.response_tokens) % 2)\n")
            sets += ["rl.algorithm.overlong_buffer_length=2", f"reward.fn='{reward}:spread'"]
        if name == "distill.toml":  # the teacher: the tiny model itself (a teacher of its vocabulary)
            sets += [f"distill.path='{tiny_run_inputs / 'model'}'"]
        if name == "judge.toml":
            url = request.getfixturevalue("fake_judge_url")
            sets += [f"reward.judge.url='{url}'", "reward.judge.template='{prompt} {response}'"]
        command, metrics = "rl", "metrics_rl.jsonl"
    args = [command, "--config", str(EXAMPLES / name)]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    records = read_jsonl(out / metrics)
    assert [r["step"] for r in records] == [1, 2]
    if name == "distill.toml":
        # the teacher is the starting student: the same distributions at every position, so no
        # gradient (the advantages are replaced by zeros) and the student stays its teacher
        assert all(abs(r["distill/divergence"]) < 1e-6 for r in records)
    if name == "judge.toml":
        assert all(r["num_reward_errors"] == 0 for r in records)
