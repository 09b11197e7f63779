"""Multi-turn tool rollouts: tool output is masked out, tokens are passed through untouched."""

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.loops.rollouts.multiturn import run_tool_rollout
from rollouts.types import Sample, SamplingParams, Status, thaw

TOOL = 9  # token id of the word "tool" in the fake tokenizer: a turn containing it calls the tool


class FakeTokenizer:
    """Token i <-> character chr(97 + i); ids >= 26 are specials that decode to nothing."""

    eos_token_id = 30
    pad_token_id = 31

    def encode(self, text, add_special_tokens=True):
        return [ord(c) - 97 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i) for i in ids if i < 26)

    def apply_chat_template(self, conversation, **kwargs):
        raise NotImplementedError


class ScriptedEngine:
    """Replies with scripted turns; records every prompt it was sent."""

    name = "scripted"

    def __init__(self, turns, status=Status.COMPLETED, logprobs=True):
        self.turns, self.status, self.seen, self.logprobs = list(turns), status, [], logprobs

    async def generate(self, prompts, params):
        (prompt,) = prompts
        self.seen.append(list(prompt))
        reply = self.turns.pop(0)[: params.max_new_tokens]
        return [
            Sample(
                tokens=list(prompt) + reply,
                num_prompt_tokens=len(prompt),
                loss_mask=[0] * len(prompt) + [1] * len(reply),
                rollout_logprobs=[-0.5] * len(reply) if self.logprobs else None,
                status=self.status,
                weight_version=3,
            )
        ]

    async def update_weights_from_disk(self, path, weight_version):
        pass

    async def weight_version(self):
        return 3

    async def health(self):
        return True


def _rollout(engine, prompt, **kwargs):
    kwargs.setdefault("tool_parser", lambda text: text if "j" in text else None)  # "j" is token 9
    kwargs.setdefault("tool_executor", lambda call: "xyz")
    return trio.run(
        lambda: run_tool_rollout(engine, FakeTokenizer(), prompt, SamplingParams(max_new_tokens=8), **kwargs)
    )


@settings(max_examples=40, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 8), min_size=1, max_size=6),
    turns=st.lists(st.lists(st.integers(0, 8), min_size=1, max_size=5), min_size=1, max_size=4),
)
def test_tool_tokens_are_masked_and_history_is_never_retokenized(prompt, turns):
    script = [t + [TOOL] for t in turns[:-1]] + [turns[-1]]  # every turn but the last calls the tool
    engine = ScriptedEngine(script)
    sample = _rollout(engine, prompt, max_turns=len(script))
    tool = [23, 24, 25]  # "xyz"
    expected = list(prompt)
    expected_mask = [0.0] * len(prompt)
    for i, turn in enumerate(script):
        assert engine.seen[i] == expected  # the engine got the exact tokens so far
        expected += turn
        expected_mask += [1.0] * len(turn)
        if i < len(script) - 1:
            expected += tool
            expected_mask += [0.0] * 3
    assert list(sample.tokens) == expected and list(sample.loss_mask) == expected_mask
    assert [lp for lp, m in zip(sample.rollout_logprobs, sample.loss_mask[len(prompt) :], strict=True) if m == 0] == [
        0.0
    ] * 3 * (len(script) - 1)
    assert sample.metadata["tool_calls"] == len(script) - 1 and sample.status is Status.COMPLETED


def test_bounds_hold():
    engine = ScriptedEngine([[1, TOOL]] * 10)
    sample = _rollout(engine, [0], max_turns=3)
    # The third turn still calls the tool: not run (nothing would answer it), and the sample is cut.
    assert sample.metadata["turns"] == 3 and sample.metadata["tool_calls"] == 2 and sample.status is Status.TRUNCATED
    # which weights sampled which tokens: the engine's turns (version 3), the tool output none
    assert thaw(sample.metadata["version_segments"]) == [[3, 2], [None, 3], [3, 2], [None, 3], [3, 2]]
    assert sample.weight_version == 3
    assert list(sample.tokens[-2:]) == [1, TOOL] and sample.loss_mask[-1] == 1.0
    engine = ScriptedEngine([[1, 2, 3, TOOL]] * 10)
    sample = _rollout(engine, [0], max_turns=10, max_total_tokens=12)
    assert sample.status is Status.TRUNCATED and len(sample.tokens) <= 12
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        _rollout(ScriptedEngine([]), [0], max_turns=0)


def test_stop_condition_and_truncated_turn_end_the_rollout():
    engine = ScriptedEngine([[1, TOOL], [2, TOOL]])
    sample = _rollout(engine, [0], stop_condition=lambda s, turns: turns >= 1)
    assert sample.metadata["turns"] == 1 and len(engine.turns) == 1
    engine = ScriptedEngine([[1, TOOL]], status=Status.TRUNCATED)
    assert _rollout(engine, [0]).status is Status.TRUNCATED


def test_async_tool_executor():
    async def executor(call):
        await trio.sleep(0)
        return "ab"

    sample = _rollout(ScriptedEngine([[1, TOOL], [2]]), [0], tool_executor=executor)
    assert list(sample.tokens) == [0, 1, TOOL, 0, 1, 2]


def test_a_turn_without_logprobs_leaves_the_trajectory_without_them():
    sample = _rollout(ScriptedEngine([[1, TOOL], [2]], logprobs=False), [0])
    assert sample.rollout_logprobs is None and sample.status is Status.COMPLETED
    assert _rollout(ScriptedEngine([[1, TOOL], [2]]), [0]).rollout_logprobs is not None


class SeedRecordingEngine(ScriptedEngine):
    """Every turn calls the tool; records each call's seed."""

    def __init__(self):
        super().__init__([])
        self.seeds = []

    async def generate(self, prompts, params):
        self.seeds.append(params.seed)
        self.turns = [[1, TOOL]]
        return await super().generate(prompts, params)


def _tool_ctx(engine, seed):
    from rollouts.loops.rollouts.functions import RolloutContext

    return RolloutContext(
        engine=engine,
        sampling=SamplingParams(n=3, max_new_tokens=8, seed=seed),
        encode_prompt=lambda r: [0],
        tokenizer=FakeTokenizer(),
    )


@pytest.mark.parametrize("seed", [None, 5])
def test_each_trajectory_and_turn_of_a_seeded_group_gets_its_own_seed(seed):
    from rollouts.loops.rollouts.functions import tool_rollout
    from rollouts.loops.rollouts.multiturn import part_seed

    engine = SeedRecordingEngine()
    rollout = tool_rollout(tool_parser=lambda text: text, tool_executor=lambda call: "x", max_turns=2)
    trio.run(rollout, {"prompt": ""}, _tool_ctx(engine, seed))
    if seed is None:
        assert engine.seeds == [None] * 6
    else:
        assert sorted(engine.seeds) == sorted(part_seed(part_seed(seed, i), t) for i in range(3) for t in range(2))
        assert len(set(engine.seeds)) == 6


@pytest.mark.parametrize("executor", ["raises", "hangs", "asyncio"])
def test_a_failing_tool_is_one_named_error_within_its_limit(executor):
    import asyncio

    from rollouts.loops.rollouts.functions import tool_rollout
    from rollouts.loops.rollouts.multiturn import EnvironmentFailure

    def raises(call):
        raise ValueError("no such tool")

    async def hangs(call):
        await asyncio.sleep(600)

    async def uses_asyncio(call):
        await asyncio.sleep(0.01)
        raise ValueError("the asyncio tool broke")

    tool, message = {
        "raises": (raises, r"^tool .*raises: .*raises raised ValueError: no such tool$"),
        "hangs": (hangs, r"^tool .*hangs: .*hangs took longer than 0.3 s; its task is cancelled$"),
        "asyncio": (uses_asyncio, r"^tool .*uses_asyncio: .*uses_asyncio raised ValueError: the asyncio tool broke$"),
    }[executor]
    rollout = tool_rollout(tool_parser=lambda text: text, tool_executor=tool, max_turns=2, tool_timeout_s=0.3)

    async def main():
        start = trio.current_time()
        with pytest.raises(EnvironmentFailure, match=message):
            await rollout({"prompt": ""}, _tool_ctx(SeedRecordingEngine(), None))
        return trio.current_time() - start

    assert trio.run(main) < 0.3 + 2.0
