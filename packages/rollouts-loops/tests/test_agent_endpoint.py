"""The agent endpoint over HTTP with a scripted engine: the wire format, its refusals, stop strings,
token-id prompts, per-turn seeds, and episodes turned into Samples (a property over split points)."""

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.data.rollout import EPISODE_KEY, num_episodes, validate_group
from rollouts.loops.agents.endpoint import EndpointLimits, serve_agent_endpoint
from rollouts.loops.agents.episode import Turn, episode_samples, turn_seed
from rollouts.loops.recipes.tiny import build_tokenizer
from rollouts.types import Sample, SamplingParams, Status

TOKENIZER = build_tokenizer(["calc: 12*3 = 36 answer: 36 what is"] * 4, vocab_size=40)


class ScriptedEngine:
    """Answers each call with the next scripted text's ids; log-prob -0.25 per token; records params."""

    name = "scripted"

    def __init__(self, texts):
        self.texts, self.calls = list(texts), []

    async def generate(self, prompts, params):
        (prompt,) = prompts
        self.calls.append((tuple(prompt), params))
        ids = TOKENIZER.encode(self.texts.pop(0), add_special_tokens=False)[: params.max_new_tokens]
        return [
            Sample(
                tokens=(*prompt, *ids),
                num_prompt_tokens=len(prompt),
                loss_mask=[0.0] * len(prompt) + [1.0] * len(ids),
                rollout_logprobs=[-0.25] * len(ids),
                weight_version=5,
                status=Status.COMPLETED,
            )
        ]


def _serve(texts, requests, *, sampling=None, limits=None):
    """Run `requests(client, base_url)` against an endpoint over a scripted engine; (result, episode, engine)."""
    engine = ScriptedEngine(texts)
    out = {}

    async def main():
        params = sampling or SamplingParams(max_new_tokens=8, seed=7)
        async with serve_agent_endpoint(engine, TOKENIZER, params, limits) as endpoint:
            episode = endpoint.open_episode(index=2, seed=params.seed)
            async with httpx.AsyncClient(timeout=10.0) as client:
                out["result"] = await requests(client, episode.base_url)
            out["episode"] = endpoint.close_episode(episode)

    trio.run(main)
    return out["result"], out["episode"], engine


def _chat(content, **extra):
    return {"model": "policy", "messages": [{"role": "user", "content": content}], **extra}


def test_a_chat_turn_answers_in_openai_format_with_the_sampled_log_probs():
    async def ask(client, url):
        return (await client.post(f"{url}/chat/completions", json=_chat("what is 12*3", logprobs=True))).json()

    body, episode, engine = _serve(["calc: 12*3"], ask)
    (choice,) = body["choices"]
    assert body["object"] == "chat.completion" and choice["message"] == {"role": "assistant", "content": "calc: 12*3"}
    assert choice["finish_reason"] == "stop"
    assert [t["logprob"] for t in choice["logprobs"]["content"]] == [-0.25] * body["usage"]["completion_tokens"]
    assert "".join(t["token"] for t in choice["logprobs"]["content"]) == "calc: 12*3"
    (turn,) = episode.turns
    assert turn.prompt_ids == engine.calls[0][0] and turn.weight_version == 5
    # the turn's seed: the group's, the episode's index and the turn's, hashed
    assert engine.calls[0][1].seed == turn_seed(7, 2, 0, None) and engine.calls[0][1].logprobs


def test_a_second_turn_continues_the_first_turns_ids():
    async def two_turns(client, url):
        first = _chat("what is 12*3")
        await client.post(f"{url}/chat/completions", json=first)
        messages = [
            *first["messages"],
            {"role": "assistant", "content": "calc: 12*3"},
            {"role": "user", "content": "= 36"},
        ]
        return await client.post(f"{url}/chat/completions", json={"messages": messages})

    _, episode, engine = _serve(["calc: 12*3", "answer: 36"], two_turns)
    first, second = episode.turns
    assert second.prompt_ids[: len(first.context_ids)] == first.context_ids
    (sample,) = episode.samples(decode=TOKENIZER.decode, metadata={})
    assert sample.metadata[EPISODE_KEY] == episode.episode_id and sample.metadata["episode_pieces"] == 1
    assert engine.calls[1][1].seed != engine.calls[0][1].seed  # each turn its own seed


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (_chat("x", n=2), 400, "n=2 is not supported"),
        (_chat("x", stream=True), 400, "stream=True"),
        (_chat("x", tools=[{"type": "function"}]), 400, "tool calls are not parsed"),
        (_chat("x", temperature=0.5), 400, "differs from the run's temperature=1.0"),
        (_chat("x", max_tokens=3, max_completion_tokens=4), 400, "disagree"),
        ({"messages": []}, 400, "non-empty list"),
        (_chat("x", frequency_penalty=1.0), 400, "unsupported field"),
    ],
)
def test_what_the_endpoint_cannot_honour_is_refused_by_name(body, status, words):
    async def ask(client, url):
        return await client.post(f"{url}/chat/completions", json=body)

    response, episode, _ = _serve(["unused"], ask)
    assert response.status_code == status and words in response.json()["error"]["message"]
    assert episode.turns == []


def test_unknown_routes_and_closed_episodes_are_404():
    async def ask(client, url):
        root = url.split("/ep/")[0]
        return [
            (await client.post(f"{root}/ep/nope/v1/chat/completions", json=_chat("x"))).status_code,
            (await client.post(f"{url}/embeddings", json={})).status_code,
            (await client.get(f"{url}/chat/completions")).status_code,
            (await client.get(f"{url}/models")).status_code,
        ]

    codes, _, _ = _serve([], ask)
    assert codes == [404, 404, 405, 200]


def test_completions_take_token_ids_cap_max_tokens_and_cut_at_a_stop_string():
    async def ask(client, url):
        prompt = TOKENIZER.encode("what is 12*3", add_special_tokens=False)
        body = {"model": "policy", "prompt": prompt, "max_tokens": 100, "stop": ["= 3"], "logprobs": 0}
        return (await client.post(f"{url}/completions", json=body)).json()

    body, episode, engine = _serve(["calc: 12*3 = 36 answer"], ask, sampling=SamplingParams(max_new_tokens=20))
    (choice,) = body["choices"]
    assert choice["text"] == "calc: 12*3 " and choice["finish_reason"] == "stop"
    assert engine.calls[0][1].max_new_tokens == 20  # capped at the run's
    (turn,) = episode.turns
    assert TOKENIZER.decode(list(turn.sampled_ids)).startswith("calc: 12*3 = 3")  # kept up to the stop's last token
    assert len(choice["logprobs"]["tokens"]) == len(turn.sampled_ids)


def test_an_episode_past_its_limits_is_refused():
    async def ask(client, url):
        codes = []
        for _ in range(3):
            codes.append((await client.post(f"{url}/chat/completions", json=_chat("what is 12*3"))).status_code)
        return codes

    codes, episode, _ = _serve(["a", "b", "c"], ask, limits=EndpointLimits(max_turns=2))
    assert codes == [200, 200, 400] and len(episode.turns) == 2

    async def long(client, url):
        return await client.post(f"{url}/chat/completions", json=_chat("what is 12*3 " * 20))

    response, _, _ = _serve(["a"], long, limits=EndpointLimits(max_total_tokens=16))
    assert response.status_code == 400 and "max_total_tokens" in response.json()["error"]["message"]


def _turn(prompt, sampled, logprob):
    return Turn(
        prompt_ids=tuple(prompt),
        sampled_ids=tuple(sampled),
        logprobs=(logprob,) * len(sampled),
        weight_version=len(prompt),
        status=Status.COMPLETED,
        context_text="",
    )


@settings(max_examples=60, deadline=None)
@given(
    parts=st.lists(
        st.tuples(
            st.lists(st.integers(1, 50), min_size=1, max_size=5),
            st.lists(st.integers(1, 50), max_size=5),
            st.booleans(),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_an_episode_becomes_one_sample_per_append_only_run_with_the_sampled_tokens_trained(parts):
    """Each turn adds ids then samples ids; a turn flagged `fresh` starts over (the template rewrote
    the past). Every piece keeps its turns' ids as sampled: trained exactly on the sampled ids."""
    turns, context = [], []
    for i, (added, sampled, fresh) in enumerate(parts):
        prompt = [100 + i, *added] if fresh or not turns else [*context, *added]  # 100 + i: no context starts so
        turns.append(_turn(prompt, sampled, -0.5 - i))
        context = [*prompt, *sampled]
    samples = episode_samples(turns, episode_id="e", decode=lambda ids: "", metadata={})
    starts = 1 + sum(1 for i, (_, _, fresh) in enumerate(parts) if i and fresh)
    assert len(samples) == starts and num_episodes(samples) == 1
    other = Sample(tokens=(1, 2), num_prompt_tokens=1, loss_mask=(0.0, 1.0), status=Status.COMPLETED)
    validate_group([*samples, other], 2, prompt="p")  # the pieces count as one episode of the group
    trained = [
        (t, lp)
        for s in samples
        for t, m, lp in zip(
            s.tokens[s.num_prompt_tokens :], s.loss_mask[s.num_prompt_tokens :], s.rollout_logprobs, strict=True
        )
        if m
    ]
    assert trained == [(t, -0.5 - i) for i, turn in enumerate(turns) for t in turn.sampled_ids]
    assert all(s.metadata["episode_pieces"] == starts for s in samples)


def test_agent_reward_takes_the_agents_and_falls_back_to_the_runs():
    from rollouts.loops import agent_reward
    from rollouts.loops.rollouts.scoring import GroupScorer

    def length(sample, record):
        return float(len(sample.response))

    returned = Sample(response="abc", metadata={"agent_reward": 0.5}, status=Status.COMPLETED)
    left = Sample(response="abcd", status=Status.COMPLETED)
    scored = trio.run(GroupScorer(agent_reward(length)).score, [returned, left], {})
    assert [s.reward for s in scored] == [0.5, 4.0]
    (unscored,) = trio.run(GroupScorer(agent_reward()).score, [left], {})  # a reward error, counted as such
    assert "no reward function scores the episode" in unscored.metadata["reward_error"]


def test_a_run_file_names_its_agent_by_path(tmp_path):
    from rollouts.loops.app.config import ConfigError, RLRun, build_run
    from rollouts.loops.app.rl_hooks import resolve_hooks

    (tmp_path / "my_agent.py").write_text("async def run(base_url, record):\n    return 1.0\n")
    source = str(tmp_path / "run.toml")
    run = build_run(RLRun, {"agent": {"fn": "my_agent.py:run", "max_turns": 3}, "reward": {"fn": "exact_match"}})
    hooks = resolve_hooks(run, source)
    assert callable(hooks["rollout"]) and hooks["reward"].fn is not None
    with pytest.raises(ConfigError, match="hooks.rollout"):
        build_run(RLRun, {"agent": {"fn": "my_agent.py:run"}, "hooks": {"rollout": "x.py:r"}})
    with pytest.raises(ConfigError, match="max_turns"):
        build_run(RLRun, {"agent": {"fn": "my_agent.py:run", "max_turns": 0}})
    bad = build_run(RLRun, {"agent": {"fn": "my_agent.py:missing"}})
    with pytest.raises(ConfigError, match="agent.fn"):
        resolve_hooks(bad, source)
