"""ProcessEngine against InProcessEngine (same weights and seed: the same Samples), its weight
sync, abort and resume, and what a dead, hung or closed engine process does."""

import copy
import dataclasses
import os
import signal

import pytest
import safetensors.torch
import torch
import trio
from helpers import tiny_model

from rollouts.backends import EngineProcessError, EngineProcessOptions, InProcessEngine, ProcessEngine
from rollouts.backends.checkpoint.export import model_tensors
from rollouts.types import InferenceEngine, SamplingParams, Status

pytestmark = pytest.mark.slow  # each test starts engine processes (seconds each)

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
_SHORT_TIMEOUT_S = 2.0  # a stopped engine process never answers; this only bounds the test's wait


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def engine(model):
    with ProcessEngine.from_model(model, weight_version=0) as engine:
        yield engine


def _weights_dir(model, path):
    path.mkdir()
    model.config.save_pretrained(path)
    safetensors.torch.save_file(model_tensors(model), path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=3, max_new_tokens=8, seed=7),
        SamplingParams(n=2, max_new_tokens=5, seed=1, temperature=0.7, top_p=0.9, top_k=20),
        SamplingParams(n=1, max_new_tokens=4, temperature=0.0, logprobs=False),
        SamplingParams(n=2, max_new_tokens=6, seed=3, stop_token_ids=(7, 20, 33)),
    ],
)
def test_seeded_samples_equal_the_in_process_engines(engine, model, params):
    reference = InProcessEngine(model, shares_training_model=False)
    assert trio.run(engine.generate, PROMPTS, params) == trio.run(reference.generate, PROMPTS, params)


def test_one_seed_per_prompt_gives_the_in_process_engines_samples(engine, model):
    params, seeds = SamplingParams(n=2, max_new_tokens=6), [11, 12, 13]
    reference = InProcessEngine(model, shares_training_model=False)
    ours = trio.run(engine.generate_seeded, PROMPTS, params, seeds)
    assert ours == trio.run(reference.generate_seeded, PROMPTS, params, seeds)
    assert all(s.rollout_logprobs is not None and len(s.rollout_logprobs) == s.response_length for s in ours)


def test_a_bad_request_is_a_value_error_and_the_engine_serves_on(engine):
    assert isinstance(engine, InferenceEngine)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        trio.run(engine.generate, [[10**6]], SamplingParams(max_new_tokens=2))
    assert len(trio.run(engine.generate, PROMPTS[:1], SamplingParams(n=2, max_new_tokens=2))) == 2
    assert trio.run(engine.health)


def test_a_disk_sync_changes_the_samples_and_the_version_and_clears_an_abort(model, tmp_path):
    seeded, greedy = (
        SamplingParams(n=2, max_new_tokens=6, seed=0),
        SamplingParams(n=2, max_new_tokens=6, temperature=0.0),
    )
    other = tiny_model(seed=5)
    with ProcessEngine.from_model(model, weight_version=0) as engine:
        before = trio.run(engine.generate, PROMPTS, seeded)
        engine.abort()
        cut = trio.run(engine.generate, PROMPTS, greedy)
        again = trio.run(engine.generate, PROMPTS, greedy)  # still aborted: nothing cleared it
        engine.resume()
        whole = trio.run(engine.generate, PROMPTS, greedy)
        engine.abort()
        trio.run(engine.update_weights_from_disk, str(_weights_dir(other, tmp_path / "w")), 3)  # clears the abort
        after, synced = trio.run(engine.generate, PROMPTS, seeded), trio.run(engine.generate, PROMPTS, greedy)
        assert trio.run(engine.weight_version) == 3
        with pytest.raises(ValueError, match="only grow"):
            trio.run(engine.update_weights_from_disk, str(tmp_path / "w"), 2)
        with pytest.raises(ValueError, match="not a directory"):
            trio.run(engine.update_weights_from_disk, str(tmp_path / "missing"), 4)
    aborted = InProcessEngine(model, shares_training_model=False)
    aborted.abort()
    assert cut == again == trio.run(aborted.generate, PROMPTS, greedy)
    assert all(s.status is Status.ABORTED and s.response_length == 1 and s.metadata["partial"] for s in cut)
    assert all(s.status is not Status.ABORTED and "partial" not in s.metadata for s in whole + synced)
    assert whole == trio.run(InProcessEngine(model, shares_training_model=False).generate, PROMPTS, greedy)
    served_other = InProcessEngine(other, shares_training_model=False, weight_version=3)
    assert after == trio.run(served_other.generate, PROMPTS, seeded) and all(s.weight_version == 3 for s in after)
    assert synced == trio.run(served_other.generate, PROMPTS, greedy)
    assert [s.tokens for s in before] != [s.tokens for s in after] and all(s.weight_version == 0 for s in before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_loaded_through_shared_memory_are_the_weights_served(dtype):
    params = SamplingParams(n=2, max_new_tokens=6, seed=0)
    base, other = tiny_model(seed=0, dtype=dtype), tiny_model(seed=5, dtype=dtype)

    def at(samples, version):
        return [dataclasses.replace(s, weight_version=version) for s in samples]

    if dtype == torch.float32:  # what serving `other` gives: the in-process engine's samples (as tested above)
        expected_other = trio.run(InProcessEngine(other, shares_training_model=False).generate, PROMPTS, params)
    else:  # bf16: the two engines' tokens agree, their log-probs only within bf16's rounding (2e-3): a fresh process's
        with ProcessEngine.from_model(other, weight_version=0) as fresh:
            expected_other = trio.run(fresh.generate, PROMPTS, params)
    with ProcessEngine.from_model(base, weight_version=0) as engine:
        expected_base = trio.run(engine.generate, PROMPTS, params)
        for version, source, expected in (
            (2, other, expected_other),
            (3, base, expected_base),
            (4, other, expected_other),
        ):
            trio.run(engine.load_weights, model_tensors(source), version)  # each load replaces every weight
            assert trio.run(engine.generate, PROMPTS, params) == at(expected, version)
            assert trio.run(engine.weight_version) == version
        engine.abort()
        trio.run(engine.load_weights, model_tensors(other), 5)  # a load clears an abort, as a sync does
        assert trio.run(engine.generate, PROMPTS, params) == at(expected_other, 5)
    assert expected_base != at(expected_other, 0)
    if dtype == torch.float32:  # the in-process engine's own direct load gives the same samples
        reference = InProcessEngine(tiny_model(seed=0, dtype=dtype), shares_training_model=False)
        trio.run(reference.load_weights, model_tensors(other), 4)
        assert trio.run(reference.generate, PROMPTS, params) == at(expected_other, 4)


def test_loads_are_checked_taken_before_they_return_and_a_refusal_raises_from_the_load(model):
    """Loads this side can check are refused before anything is sent, and the engine serves on.
    load_weights returns once the engine process has copied the tensors into its model. One it
    refuses (here: a weight this side was told of and the engine's model lacks) raises from that
    load_weights call, naming the refusal; the engine may hold part of it, so every later call
    says so too."""
    tensors = model_tensors(model)
    with ProcessEngine.from_model(model, weight_version=1, name="told") as engine:
        with pytest.raises(ValueError, match="only grow"):
            trio.run(engine.load_weights, tensors, 0)
        with pytest.raises(TypeError, match="not a torch.Tensor"):
            trio.run(engine.load_weights, {**tensors, "extra": [1.0]}, 2)
        with pytest.raises(TypeError, match="has dtype torch.int64"):
            trio.run(engine.load_weights, {**tensors, "extra": torch.zeros(2, dtype=torch.int64)}, 2)
        with pytest.raises(ValueError, match="do not fit the model: .*unexpected \\['no.such.weight'\\]"):
            trio.run(engine.load_weights, {**tensors, "no.such.weight": torch.zeros(3)}, 2)
        name = next(iter(tensors))
        with pytest.raises(ValueError, match="do not fit the model: missing"):
            trio.run(engine.load_weights, {k: v for k, v in tensors.items() if k != name}, 2)
        with pytest.raises(ValueError, match=f"{name!r} has shape \\(1, "):
            trio.run(engine.load_weights, {**tensors, name: tensors[name].reshape(1, -1)}, 2)
        assert trio.run(engine.weight_version) == 1 and trio.run(engine.health)

        changed = {k: v + 1.0 for k, v in tensors.items()}
        trio.run(engine.load_weights, changed, 2)
        for v in changed.values():
            v.zero_()  # the caller may change its tensors as soon as the load returns
        after = trio.run(engine.generate, PROMPTS, SamplingParams(max_new_tokens=3, temperature=0.0))
        reference = InProcessEngine(copy.deepcopy(model), shares_training_model=False)
        trio.run(reference.load_weights, {k: v + 1.0 for k, v in tensors.items()}, 2)
        assert after == trio.run(reference.generate, PROMPTS, SamplingParams(max_new_tokens=3, temperature=0.0))

        engine._shapes["extra"], engine._storage["extra"] = (3,), -1  # this side's check passes it
        with pytest.raises(EngineProcessError, match="told: .*refused the weight load of version 3 .*extra"):
            trio.run(engine.load_weights, {**tensors, "extra": torch.zeros(3)}, 3)
        assert trio.run(engine.weight_version) == 2 and not trio.run(engine.health)
        with pytest.raises(EngineProcessError, match="told: .*refused the weight load of version 3 .*extra"):
            trio.run(engine.generate, PROMPTS, SamplingParams(max_new_tokens=2))


def test_a_killed_engine_process_is_an_error_naming_its_exit_code(model):
    engine = ProcessEngine.from_model(model, name="victim")
    os.kill(engine.pid, signal.SIGKILL)
    with pytest.raises(
        EngineProcessError, match=rf"victim: engine process {engine.pid} exited during 'generate'.*exit code -9"
    ):
        trio.run(engine.generate, PROMPTS, SamplingParams(max_new_tokens=2))
    assert not trio.run(engine.health)
    with pytest.raises(EngineProcessError, match="exit code -9"):  # every later call says the same
        trio.run(engine.generate, PROMPTS, SamplingParams(max_new_tokens=2))
    engine.close()


def test_a_hung_engine_process_is_killed_at_its_timeout(model):
    engine = ProcessEngine.from_model(model, timeout_s=_SHORT_TIMEOUT_S)
    os.kill(engine.pid, signal.SIGSTOP)  # alive but never answers
    with pytest.raises(EngineProcessError, match=r"gave no answer to 'generate' within timeout_s=2.0; killed"):
        trio.run(engine.generate, PROMPTS, SamplingParams(max_new_tokens=2))
    assert engine._child.process.returncode == -signal.SIGKILL  # reaped, not left stopped
    engine.close()


def test_an_engine_process_that_fails_to_start_reports_its_stderr(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(
        EngineProcessError,
        match=r"exited before it was ready.*exit code 1; stderr tail:\n(.|\n)*has no model.safetensors",
    ):
        ProcessEngine(tmp_path, EngineProcessOptions(start_timeout_s=300.0))
    with pytest.raises(ValueError, match="has no config.json"):
        ProcessEngine(tmp_path / "missing")


def test_close_reaps_the_process_and_deletes_its_files(model):
    with pytest.raises(RuntimeError, match="inside the block"):
        with ProcessEngine.from_model(model) as engine:
            child = engine._child
            files, dirs = child.files, child.dirs
            assert all(p.exists() for p in files + dirs) and dirs
            raise RuntimeError("inside the block")
    assert child.process.returncode == 0  # it exited on the close request
    assert not any(p.exists() for p in files + dirs)
    with pytest.raises(EngineProcessError, match="closed"):
        trio.run(engine.generate, PROMPTS, SamplingParams(max_new_tokens=2))
    engine.close()  # idempotent
    engine.abort()  # a no-op once closed
    assert not trio.run(engine.health)


def test_a_bad_prompt_is_refused_by_check_prompts_before_the_engine_process_sees_it(engine, model):
    from rollouts.types import SamplingParams

    vocab = model.config.vocab_size
    params = SamplingParams(max_new_tokens=4)
    engine.check_prompts([[1, 2, 3]], params)  # fine
    with pytest.raises(ValueError, match=rf"prompt 1 has token ids \[{vocab}\] outside the vocabulary"):
        engine.check_prompts([[1, 2], [3, vocab]], params)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        engine.check_prompts([[]], params)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        engine.check_prompts([[1] * model.config.max_position_embeddings], params)
