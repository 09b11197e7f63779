"""Reward models: a one-label classification model scores samples in process and through a real
vLLM CPU server (`--runner pooling`) with the same numbers; bad model directories are refused by
name; weighted combination with a verifier reward."""

import json
import os
import shutil

import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

from rollouts.loops.app.config import RewardModelSpec, RewardSpec
from rollouts.loops.app.rl_hooks import _with_reward_models
from rollouts.loops.rollouts.reward_models import (
    ClassifierRewardModel,
    check_reward_model_dir,
    reward_model_reward,
    strip_trailing_pad,
    weighted_reward,
)
from rollouts.loops.rollouts.scoring import GroupScorer, Reward
from rollouts.sync.fake_server import FakeEngineState, serve_fake_engine
from rollouts.types import Sample

# float32 on both sides, the same ids (none ends in the pad id), the same pooled token: only summation order differs.
SCORE_ATOL = 1e-4


@pytest.fixture(scope="module")
def reward_model_dir(tiny_run_inputs, tmp_path_factory):
    """A random-init Qwen2ForSequenceClassification (num_labels 1, head_dim 32) with the tiny tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_run_inputs / "model"), local_files_only=True)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():  # scores of a visible size (the head starts near 0)
        model.score.weight.normal_(0.0, 1.0)
    out = tmp_path_factory.mktemp("reward_model")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _sequences():
    return [[3, 4, 5, 6, 7], [9, 8], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5], [2, 12, 13]]  # vocabulary of 14


def test_a_directory_that_is_not_a_one_label_classifier_is_refused(tiny_run_inputs, reward_model_dir, tmp_path):
    check_reward_model_dir(reward_model_dir)
    with pytest.raises(ValueError, match="ForSequenceClassification"):
        check_reward_model_dir(tiny_run_inputs / "model")  # a causal LM
    shutil.copytree(reward_model_dir, tmp_path / "two")
    config = json.loads((tmp_path / "two" / "config.json").read_text())
    (tmp_path / "two" / "config.json").write_text(json.dumps({**config, "num_labels": 2, "id2label": {0: "a", 1: "b"}}))
    with pytest.raises(ValueError, match="num_labels = 1"):
        check_reward_model_dir(tmp_path / "two")
    with pytest.raises(ValueError, match="no config.json"):
        check_reward_model_dir(tmp_path / "missing")


@settings(max_examples=15, deadline=None)
@given(order=st.permutations(range(4)), batch=st.integers(1, 4))
def test_in_process_scores_are_the_models_logit_whatever_the_batching(reward_model_dir, order, batch):
    rm = ClassifierRewardModel.load(reward_model_dir, batch_size=batch)
    sequences = [_sequences()[i] for i in order]
    scores = rm.score(sequences)
    for ids, score in zip(sequences, scores, strict=True):  # one sequence alone, no padding: HF's own forward
        with torch.no_grad():
            alone = rm.model(input_ids=torch.tensor([ids])).logits[0, 0].item()
        assert score == pytest.approx(alone, abs=1e-5)


def _ending_in_pad(pad):
    """Sequences whose last tokens have the pad id (an EOS that shares it), and one of pads only."""
    return [[3, 4, pad], [6, pad, 7, pad, pad], [pad, pad], [5, 9, 2, 8, pad]]


def test_in_process_scores_take_the_last_non_pad_token_as_transformers(reward_model_dir):
    """transformers' *ForSequenceClassification (and TRL) score the last token whose id is not the pad id,
    so an EOS sharing the pad id is skipped; vLLM's last-token pooling would score it."""
    rm = ClassifierRewardModel.load(reward_model_dir, batch_size=4)
    sequences = _ending_in_pad(rm.pad_token_id)
    scores = rm.score(sequences)
    for ids, score in zip(sequences, scores, strict=True):
        with torch.no_grad():
            reference = rm.model(input_ids=torch.tensor([ids])).logits[0, 0].item()
            last_token = rm.model.score(rm.model.model(input_ids=torch.tensor([ids]))[0][0, -1]).item()
        assert score == pytest.approx(reference, abs=1e-5)
        if ids[0] != ids[-1]:  # the all-pad row scores its first token, which is also a pad
            assert score != pytest.approx(last_token, abs=1e-3)


@settings(max_examples=20, deadline=None)
@given(ids=st.lists(st.integers(0, 13), min_size=1, max_size=12))
def test_trailing_pad_ids_are_dropped_down_to_one_token(ids):
    pad = 0
    kept = strip_trailing_pad(ids, pad)
    assert ids[: len(kept)] == kept and all(x == pad for x in ids[len(kept) :])
    assert len(kept) >= 1 and (kept[-1] != pad or kept == [pad])


def test_a_reward_scorer_given_the_pad_id_reads_ids_without_trailing_pads():
    """What makes a vLLM server (last-token pooling) score the token transformers scores."""
    seen = []

    class Recorder:
        def score(self, inputs):
            seen.extend(inputs)
            return [0.0] * len(inputs)

    samples = [Sample(tokens=ids, num_prompt_tokens=1, loss_mask=[0.0] * len(ids)) for ids in _ending_in_pad(0)]
    trio.run(GroupScorer(reward_model_reward(Recorder(), pad_token_id=0)).score, samples, {})
    assert seen == [[3, 4], [6, 0, 7], [0], [5, 9, 2, 8]]


def test_a_run_files_url_reward_model_is_sent_ids_without_trailing_pads(reward_model_dir):
    """[[reward.models]] with a url: the pad id comes from the config.json in its tokenizer_path, so
    the server's last-token pooling lands on the last non-pad token, as in process."""
    pad = json.loads((reward_model_dir / "config.json").read_text())["pad_token_id"]
    state = FakeEngineState(vocab_size=14)
    samples = [Sample(tokens=ids, num_prompt_tokens=1, loss_mask=[0.0] * len(ids)) for ids in _ending_in_pad(pad)]

    async def scored():
        async with serve_fake_engine(state) as server:
            spec = RewardSpec(
                weight=0.0, models=(RewardModelSpec(url=server.url, tokenizer_path=str(reward_model_dir)),)
            )
            return await GroupScorer(_with_reward_models(None, spec, "run.toml")).score(samples, {})

    rewards = [s.reward for s in trio.run(scored)]
    assert rewards == [state.score(strip_trailing_pad(ids, pad)) for ids in _ending_in_pad(pad)]
    assert rewards != [state.score(ids) for ids in _ending_in_pad(pad)]


def test_a_url_reward_model_without_a_tokenizer_path_warns_of_the_pad_id():
    with pytest.warns(UserWarning, match="pad id"):
        _with_reward_models(
            None, RewardSpec(weight=0.0, models=(RewardModelSpec(url="http://127.0.0.1:1"),)), "run.toml"
        )


def test_a_weighted_reward_adds_a_verifier_and_a_reward_model(reward_model_dir):
    rm = ClassifierRewardModel.load(reward_model_dir)
    samples = [
        Sample(tokens=ids, num_prompt_tokens=1, loss_mask=[0.0] + [1.0] * (len(ids) - 1)) for ids in _sequences()
    ]
    verifier = lambda sample, record: float(len(sample.tokens) % 2)  # noqa: E731
    combined = weighted_reward([(verifier, 2.0), (reward_model_reward(rm), 0.5)])
    scored = trio.run(GroupScorer(combined).score, samples, {})
    expected = [2.0 * (len(ids) % 2) + 0.5 * s for ids, s in zip(_sequences(), rm.score(_sequences()), strict=True)]
    assert [s.reward for s in scored] == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="finite"):
        weighted_reward([(verifier, float("nan"))])
    assert isinstance(combined, Reward) and combined.batched


@pytest.mark.vllm
@pytest.mark.slow
def test_in_process_and_vllm_score_the_same_within_1e_4(reward_model_dir):
    from rollouts.sync.launch import VLLMServeOptions, launch_vllm_server
    from rollouts.sync.reward_client import VLLMRewardModel
    from rollouts.sync.testing import find_vllm_python, vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason is not None:
        pytest.skip(f"vLLM CPU server unavailable: {reason}")
    local = ClassifierRewardModel.load(reward_model_dir).score(_sequences())
    with launch_vllm_server(
        reward_model_dir,
        options=VLLMServeOptions(
            dtype="float32",
            max_model_len=64,
            enforce_eager=True,
            worker_extension=False,
            extra_args=["--runner", "pooling"],
        ),
        python=find_vllm_python(),
        env={"VLLM_CPU_KVCACHE_SPACE": "1", **{k: v for k, v in os.environ.items() if k.startswith("OMP_")}},
    ) as server:

        async def remote():
            async with VLLMRewardModel(server.url, timeout_s=60) as rm:
                return await rm.score(_sequences())

        served = trio.run(remote)
    assert served == pytest.approx(local, abs=SCORE_ATOL), (served, local)


def test_rollouts_rl_adds_a_reward_model_to_the_verifier_by_weight(tiny_run_inputs, reward_model_dir, tmp_path, capsys):
    from run_configs import rl_toml

    from rollouts.loops.app.cli import main
    from rollouts.loops.run.loggers import read_jsonl

    extra = f'[[reward.models]]\npath = "{reward_model_dir}"\nweight = 0.5\n'
    config = rl_toml(tiny_run_inputs, tmp_path / "rm", tiny_run_inputs / "model", extra=extra)
    assert main(["rl", "--config", str(config), "--set", "rl.num_steps=2", "--set", "reward.weight=0"]) == 0
    records = read_jsonl(tmp_path / "rm" / "metrics_rl.jsonl")
    assert len(records) == 2 and all(r["reward_mean"] != 0.0 for r in records)  # the model's scores alone
    resolved = (tmp_path / "rm" / "resolved_config.toml").read_text()
    assert f'path = "{reward_model_dir}"' in resolved  # the resolved config keeps the table
    bad = rl_toml(
        tiny_run_inputs,
        tmp_path / "bad",
        tiny_run_inputs / "model",
        extra=extra.replace(str(reward_model_dir), str(tiny_run_inputs / "model")),
    )
    assert main(["rl", "--config", str(bad)]) == 2
    assert "reward.models[0]" in capsys.readouterr().err
    both = rl_toml(
        tiny_run_inputs, tmp_path / "both", tiny_run_inputs / "model", extra=extra + 'url = "http://127.0.0.1:1"\n'
    )
    assert main(["rl", "--config", str(both)]) == 2
    assert "RewardModelSpec.path" in capsys.readouterr().err
