"""The RL loop with the in-process sampler: a toy reward rises, and every algorithm preset runs."""

import dataclasses
import json

import pytest
import torch
from run_configs import tiny_rl_config

from rollouts.backends import InProcessEngine, build_components, load_hf_model
from rollouts.data import DataBuffer
from rollouts.loops.algorithms import ALGORITHMS, ROLLOUT_IMPLIED
from rollouts.loops.engines.coalescing import CoalescingEngine
from rollouts.loops.rl.loop import RunOutputs, run_rl_training
from rollouts.loops.rl.models import RLModels
from rollouts.loops.run.loggers import NullLogger
from rollouts.types import CheckpointConfig, OptimizerConfig, RLConfig, RolloutConfig, SamplingParams


def _setup(inputs, *, overlap=False):
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(inputs / "model"), local_files_only=True)
    model = load_hf_model(inputs / "model")
    records = [json.loads(line) for line in (inputs / "prompts.jsonl").read_text().splitlines()]
    return tokenizer, model, records


def _run(inputs, tmp_path, *, algorithm, rollout_overrides=(), steps, lr, reward, prompts=8, n=8, resume=False):
    tokenizer, model, records = _setup(inputs)
    config = tiny_rl_config(
        tokenizer, algorithm=algorithm, steps=steps, lr=lr, prompts=prompts, n=n, **dict(rollout_overrides)
    )
    components = build_components(model, config.optimizer, num_training_steps=steps * algorithm.num_updates_per_batch)
    engine = CoalescingEngine(InProcessEngine(model, tokenizer=tokenizer), max_prompts_per_call=prompts)

    def encode(record):
        return tokenizer.encode(record["prompt"], add_special_tokens=False)

    return run_rl_training(
        RLModels(policy=components, engine=engine, engine_shares_model=True),
        DataBuffer(records, seed=0),
        config,
        reward=reward,
        encode_prompt=encode,
        output=RunOutputs(run_dir=tmp_path, logger=NullLogger(), resume=resume),
    )


def starts_with_seven(sample, record):
    return 1.0 if sample.response.startswith("7") else 0.0


def test_grpo_raises_a_toy_reward(tiny_run_inputs, tmp_path):
    state, history = _run(
        tiny_run_inputs, tmp_path, algorithm=ALGORITHMS["grpo"], steps=12, lr=1e-2, reward=starts_with_seven
    )
    rewards = [h["reward_mean"] for h in history]
    assert state.step == 12 and state.weight_version == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_preset_runs_two_steps(tiny_run_inputs, tmp_path, name):
    algorithm = ALGORITHMS[name]
    if name == "ppo":
        algorithm = dataclasses.replace(algorithm, num_updates_per_batch=2)  # exercise old log-probs too
    if algorithm.overlong_buffer_length:  # the buffer within this test's 4-token budget: the penalty still acts
        algorithm = dataclasses.replace(algorithm, overlong_buffer_length=2)
    state, history = _run(
        tiny_run_inputs,
        tmp_path,
        algorithm=algorithm,
        rollout_overrides=ROLLOUT_IMPLIED.get(name, {}),
        steps=2,
        lr=1e-3,
        reward=starts_with_seven,
        prompts=4,
        n=4,
    )
    assert state.step == 2 * algorithm.num_updates_per_batch
    for h in history:
        assert all(v == v for k, v in h.items() if k in ("loss", "grad_norm")), h  # no NaN
    if algorithm.needs_reference and algorithm.kl_placement == "reward":
        assert "kl_reward" in history[-1]


def test_a_resumed_run_keeps_the_starting_model_as_its_kl_reference(tiny_run_inputs, tmp_path, monkeypatch):
    """The reference is the model the run started from, not the checkpoint a resume loads."""
    import rollouts.loops.rl.step as rl

    algorithm = ALGORITHMS["reinforce_pp"]  # KL in the reward
    _run(tiny_run_inputs, tmp_path, algorithm=algorithm, steps=1, lr=1e-2, reward=starts_with_seven, prompts=4, n=4)
    starting = load_hf_model(tiny_run_inputs / "model").state_dict()
    seen = []
    update = rl.rl_update

    def recording_update(components, state, samples, config, *, ref_components=None, **_):
        seen.append({k: v.clone() for k, v in ref_components.model.state_dict().items()})
        return update(components, state, samples, config, ref_components=ref_components)

    monkeypatch.setattr(rl, "rl_update", recording_update)
    state, _ = _run(
        tiny_run_inputs,
        tmp_path,
        algorithm=algorithm,
        steps=2,
        lr=1e-2,
        reward=starts_with_seven,
        prompts=4,
        n=4,
        resume=True,
    )
    assert state.step == 2 and len(seen) == 1  # resumed at step 1, ran step 2
    for name, tensor in seen[0].items():
        assert torch.equal(tensor, starting[name]), name


class _EchoEngine:
    """Answers each prompt with two fixed tokens at once: the loop's bookkeeping without a model. It
    reports the weight version it was last given and stamps it on every sample, as vLLM does."""

    name = "echo"

    def __init__(self):
        self.version = 0

    async def generate(self, prompts, params):
        from rollouts.types import Sample, Status

        return [
            Sample(
                tokens=(*p, 1, 1),
                num_prompt_tokens=len(p),
                loss_mask=(0.0,) * len(p) + (1.0, 1.0),
                rollout_logprobs=(-1.0, -1.0),
                status=Status.COMPLETED,
                weight_version=self.version,
            )
            for p in prompts
            for _ in range(params.n)
        ]

    async def update_weights_from_disk(self, path, weight_version):
        self.version = weight_version

    async def weight_version(self):
        return self.version

    async def health(self):
        return True


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_resumed_run_trains_the_same_prompts_as_an_uninterrupted_one(tmp_path, monkeypatch, overlap):
    """Every checkpoint holds the batch generated ahead of it together with the buffer after it."""
    import rollouts.loops.rl.step as rl
    from rollouts.loops.recipes.tiny import build_tiny_model

    class Crash(Exception):
        pass

    trained, crash_before = [], []

    def recording_update(components, state, samples, config, **_):
        if crash_before and state.step + 1 == crash_before[0]:
            raise Crash
        trained.append(sorted({s.metadata["id"] for s in samples}))
        versions.append((state.weight_version, sorted({s.weight_version for s in samples})))
        return state.after_step(num_tokens=1, num_samples=len(samples)), {}

    monkeypatch.setattr(rl, "rl_update", recording_update)
    records = [{"prompt": f"p{i}", "id": i} for i in range(40)]
    versions = []  # the weight version each step trained, and its samples' versions

    def run(run_dir, *, resume):
        model = build_tiny_model(
            16,
            hidden_size=64,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            intermediate_size=64,
            max_position_embeddings=32,
        )
        config = RLConfig(
            num_steps=5,
            overlap=overlap,
            checkpoint=CheckpointConfig(every_steps=1, keep_last=2),
            rollout=RolloutConfig(batch_size=2, samples_per_prompt=2, sampling=SamplingParams(max_new_tokens=2)),
            optimizer=OptimizerConfig(schedule="constant"),
        )
        components = build_components(model, config.optimizer, num_training_steps=5)
        return run_rl_training(
            RLModels(policy=components, engine=_EchoEngine(), engine_shares_model=not overlap),
            DataBuffer(records, seed=0),
            config,
            reward=lambda s, r: float(r["id"]),
            encode_prompt=lambda r: [2 + r["id"] % 10],
            output=RunOutputs(run_dir=run_dir, logger=NullLogger(), resume=resume),
        )

    run(tmp_path / "straight", resume=False)
    straight, straight_versions = list(trained), list(versions)
    trained[:], versions[:] = [], []
    crash_before.append(3)
    with pytest.raises(Crash):
        run(tmp_path / "crashed", resume=False)
    crash_before.clear()
    del trained[2:], versions[2:]  # the steps the resumed run redoes
    run(tmp_path / "crashed", resume=True)
    assert trained == straight, (trained, straight)
    # Each step trains on samples of the same weight versions: the batch generated ahead of the
    # checkpoint keeps its version, and the resumed engine serves the saved weights as their version.
    assert versions == straight_versions, (versions, straight_versions)


def test_a_seeded_run_gives_the_same_weights_at_any_concurrency(tiny_run_inputs, tmp_path):
    """Per-request seeds come from each prompt's position in the data, not from which requests
    arrived together: one request at a time, or all at once coalesced into shared batches, train
    the same samples into the same weights."""
    seen = {}

    def run(concurrency, window_s):
        tokenizer, model, records = _setup(tiny_run_inputs)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=4, seed=11, stop_token_ids=(tokenizer.eos_token_id,))
        config = RLConfig(
            num_steps=2,
            rollout=RolloutConfig(batch_size=4, samples_per_prompt=4, max_concurrency=concurrency, sampling=sampling),
            algorithm=ALGORITHMS["grpo"],
            optimizer=OptimizerConfig(lr=1e-2, schedule="constant"),
            checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
            max_tokens_per_micro_batch=256,
        )
        components = build_components(model, config.optimizer, num_training_steps=2)
        engine = CoalescingEngine(
            InProcessEngine(model, tokenizer=tokenizer), max_prompts_per_call=4, window_s=window_s
        )
        scored = []

        def reward(sample, record):  # varies within groups, so every sample moves the weights
            scored.append(sample.tokens)
            return float(sum(sample.response_tokens) % 3)

        run_rl_training(
            RLModels(policy=components, engine=engine, engine_shares_model=True),
            DataBuffer(records, seed=0),
            config,
            reward=reward,
            encode_prompt=lambda r: tokenizer.encode(r["prompt"], add_special_tokens=False),
            output=RunOutputs(run_dir=tmp_path / f"c{concurrency}", logger=NullLogger()),
        )
        seen[concurrency] = sorted(scored)
        return {k: v.clone() for k, v in model.state_dict().items()}

    alone = run(1, 0.0)
    together = run(4, 0.05)  # a wide window: the four groups of a step go out as one batch
    assert seen[1] == seen[4] and len(set(seen[1])) > 8  # the same samples, and not all alike
    for name, tensor in alone.items():
        torch.testing.assert_close(together[name], tensor, rtol=0, atol=0, msg=name)


def _stale_and_fresh_batch(tiny_run_inputs):
    """One group of 2 fresh samples (version 5) and one of 2 samples three versions old (version 2)."""
    from rollouts.types import RolloutBatch, Sample, Status

    def sample(version, group, reward, tail):
        return Sample(
            tokens=(3, 4, 5, tail, tail),
            num_prompt_tokens=3,
            loss_mask=(0.0, 0.0, 0.0, 1.0, 1.0),
            rollout_logprobs=(-1.5, -2.0),
            weight_version=version,
            group_index=group,
            reward=reward,
            status=Status.COMPLETED,
        )

    samples = [sample(5, 0, 1.0, 6), sample(5, 0, 0.0, 7), sample(2, 1, 1.0, 6), sample(2, 1, 0.0, 7)]
    return RolloutBatch(samples=[s.with_metadata(id=i) for i, s in enumerate(samples)], step=0)


def test_overlap_corrects_for_the_older_policy_by_default_and_drops_samples_too_stale(tiny_run_inputs):
    """In overlap mode samples come from a policy up to max_staleness versions old: truncated
    importance weights against their rollout log-probs are applied unless turned off, and samples
    older than that are dropped (not trained), counted in num_too_stale."""
    from rollouts.loops.rl.step import rl_step
    from rollouts.types import TrainingState

    _, model, _ = _setup(tiny_run_inputs)
    batch = _stale_and_fresh_batch(tiny_run_inputs)
    state = TrainingState(weight_version=5)
    base = RLConfig(num_steps=1, overlap=True, max_staleness=1)
    assert base.effective_algorithm.is_cap == 2.0 and base.algorithm.is_cap is None

    def step(config):
        components = build_components(model, config.optimizer, num_training_steps=1)
        return rl_step(components, state, batch, config)[1]

    metrics = step(base)
    assert metrics["num_too_stale"] == 2.0 and metrics["num_trained"] == 2.0
    assert "is_weight_mean" in metrics  # the correction ran
    off = dataclasses.replace(base, overlap_is_cap=None)
    assert off.effective_algorithm.is_cap is None and "is_weight_mean" not in step(off)
    own = dataclasses.replace(base, algorithm=dataclasses.replace(base.algorithm, is_cap=3.0))
    assert own.effective_algorithm.is_cap == 3.0  # the algorithm's own setting wins
    synchronous = dataclasses.replace(base, overlap=False)
    assert synchronous.effective_algorithm.is_cap is None


def test_overlap_with_a_correction_needs_the_engines_log_probs():
    with pytest.raises(ValueError, match="rollout.sampling.logprobs"):
        RLConfig(overlap=True, rollout=RolloutConfig(sampling=SamplingParams(logprobs=False)))
    RLConfig(overlap=True, overlap_is_cap=None, rollout=RolloutConfig(sampling=SamplingParams(logprobs=False)))


class _ForgetfulEngine(InProcessEngine):
    """An engine whose weight update reports success and records the version but loads nothing (a
    sync that silently does not apply, as verl#7495 went unnoticed for two months)."""

    async def update_weights_from_disk(self, path, weight_version):
        self._weight_version = weight_version

    async def load_weights(self, tensors, weight_version):  # the direct sync the loop uses
        self._weight_version = weight_version


@pytest.mark.parametrize("engine_cls", [InProcessEngine, _ForgetfulEngine], ids=["applied", "not-applied"])
def test_the_sync_probe_catches_weights_that_did_not_arrive(tiny_run_inputs, tmp_path, engine_cls):
    import copy

    from rollouts.loops.rl.generation import SyncProbeError

    tokenizer, model, records = _setup(tiny_run_inputs)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=(tokenizer.eos_token_id,))
    config = RLConfig(
        num_steps=2,
        rollout=RolloutConfig(batch_size=4, samples_per_prompt=4, sampling=sampling),
        algorithm=ALGORITHMS["grpo"],
        optimizer=OptimizerConfig(lr=5e-2, schedule="constant"),  # large: a step moves the log-probs
        checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
        max_tokens_per_micro_batch=256,
        sync_probe_tokens=4,
        sync_probe_tolerance=1e-3,
    )
    components = build_components(model, config.optimizer, num_training_steps=2)
    engine = engine_cls(copy.deepcopy(model), shares_training_model=False, tokenizer=tokenizer, name="engine-x")

    def run():
        return run_rl_training(
            RLModels(policy=components, engine=CoalescingEngine(engine, max_prompts_per_call=4)),
            DataBuffer(records, seed=0),
            config,
            reward=lambda s, r: float(sum(s.response_tokens) % 2),
            encode_prompt=lambda r: tokenizer.encode(r["prompt"], add_special_tokens=False),
            output=RunOutputs(run_dir=tmp_path, logger=NullLogger(), resume=False),
        )

    if engine_cls is InProcessEngine:
        _, history = run()
        diffs = [h["sync_probe_logprob_diff"] for h in history]
        assert len(diffs) == 2 and max(diffs) < 1e-4, diffs  # float32 on both sides, same weights
    else:
        with pytest.raises(SyncProbeError, match=r"engine engine-x reports log-probs .* away from the trainer"):
            run()


def test_log_probs_of_another_distribution_are_refused_when_the_loss_weighs_by_them():
    """Truncated sampling and an engine reporting the full softmax (vLLM's default raw_logprobs):
    importance weights against those log-probs would be biased (TRL#6789), so the step refuses."""
    from rollouts.loops.rl.step import check_logprobs_distribution
    from rollouts.types import Sample

    def samples(of):
        return [
            Sample(
                tokens=(1, 2, 3),
                num_prompt_tokens=1,
                loss_mask=(0, 1, 1),
                rollout_logprobs=(-1.0, -1.0),
                metadata={"logprobs_of": of},
            )
        ]

    truncated = RLConfig(
        rollout=RolloutConfig(sampling=SamplingParams(temperature=0.7, top_p=0.9)),
        algorithm=dataclasses.replace(ALGORITHMS["grpo"], is_cap=2.0),
    )
    with pytest.raises(ValueError, match="--logprobs-mode processed_logprobs"):
        check_logprobs_distribution(samples("model"), truncated)
    check_logprobs_distribution(samples("sampling"), truncated)  # the distribution sampled from: fine
    check_logprobs_distribution(samples("model"), RLConfig())  # T = 1, no truncation: the same distribution
    no_weights = dataclasses.replace(truncated, algorithm=ALGORITHMS["grpo"])
    check_logprobs_distribution(samples("model"), no_weights)  # the loss does not use them


def test_rollout_correction_masks_tokens_and_logs_the_off_policy_diagnostics_each_step(tiny_run_inputs, tmp_path):
    """verl-style rejection (token-level k3 bound on log pi_old / pi_rollout) runs in the loop, and every
    step logs the engine-vs-trainer diagnostics: drift, chi-square, effective sample size."""
    algorithm = dataclasses.replace(ALGORITHMS["grpo"], rs_level="token", rs_estimator="k3", rs_high=1e-12)
    _, history = _run(tiny_run_inputs, tmp_path, algorithm=algorithm, steps=2, lr=1e-2, reward=starts_with_seven)
    for h in history:
        for key in ("offpolicy_logprob_abs_diff", "offpolicy_chi2_token", "offpolicy_ess_token", "rs_masked_frac"):
            assert key in h and h[key] == h[key], (key, h)  # present and not NaN
        assert 0.0 <= h["rs_masked_frac"] <= 1.0
