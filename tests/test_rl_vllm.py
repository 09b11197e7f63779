"""The RL loop against a real vLLM CPU server: rollouts from vLLM, weights synced back each step."""

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import trio
from run_configs import rl_toml

from rollouts.loops.app.cli import main
from rollouts.loops.loggers import read_jsonl
from rollouts.sync import VLLMEngine
from rollouts.sync.testing import find_vllm_python, reference_greedy, vllm_unavailable_reason
from rollouts.types import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def vllm_for_tiny_model(tiny_run_inputs, tmp_path_factory):
    """A vLLM server started the way a user starts one: `rollouts engine vllm` in another process,
    from another working directory, its URL read from what it prints."""
    reason = vllm_unavailable_reason()
    if reason is not None:
        pytest.skip(f"vLLM CPU server unavailable: {reason}")
    elsewhere = tmp_path_factory.mktemp("engine_cwd")
    # fmt: off
    cmd = [
        sys.executable, "-m", "rollouts.loops.app.cli", "engine", "vllm",
        "--model", str(tiny_run_inputs / "model"), "--python", find_vllm_python(),
        "--dtype", "float32", "--max-model-len", "64", "--enforce-eager", "--startup-timeout-s", "600",
    ]
    # fmt: on
    launcher = subprocess.Popen(
        cmd, cwd=elsewhere, stdout=subprocess.PIPE, text=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    )
    try:
        line = launcher.stdout.readline()  # the launcher exits (EOF) if the server is not up in 600 s
        assert line.startswith("engine ready: http://"), (line, launcher.poll(), list(elsewhere.iterdir()))
        yield SimpleNamespace(url=line.split(": ", 1)[1].strip(), cwd=elsewhere)
    finally:
        launcher.send_signal(signal.SIGTERM)  # the launcher stops its server and exits
        launcher.wait(timeout=120)


async def _served_version(url):
    async with VLLMEngine(url, timeout_s=30.0) as engine:
        return await engine.weight_version()


@pytest.mark.parametrize("sync", ["disk", "http"])
def test_rl_loop_with_vllm_engine_syncs_weights(tiny_run_inputs, vllm_for_tiny_model, tmp_path, sync):
    """The trainer and the engine run in different working directories: "disk" sends an absolute path
    (a relative one was unreadable there), "http" sends the weights in request bodies."""
    out = tmp_path / "rl_vllm"
    engine = f"""
[engine]
kind = "vllm"
urls = ["{vllm_for_tiny_model.url}"]
timeout_s = 60.0
sync = "{sync}"
"""
    config = rl_toml(tiny_run_inputs, out, tiny_run_inputs / "model", extra=engine)
    assert main(["rl", "--config", str(config), "--set", "rl.rollout.request_timeout_s=60.0"]) == 0
    records = read_jsonl(out / "metrics_rl.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["weight_version"] for r in records] == [1.0, 2.0, 3.0]
    assert all(r["num_samples"] == 16 for r in records)
    assert trio.run(_served_version, vllm_for_tiny_model.url) == 3
    # The engine serves the trained weights: greedy tokens and log-probs equal transformers' on the
    # weights the run exported last (float32 on both sides).
    prompt = [3, 4, 5, 6]
    params = SamplingParams(max_new_tokens=4, temperature=0.0, logprobs=True)

    async def served():
        async with VLLMEngine(vllm_for_tiny_model.url, timeout_s=60.0) as engine:
            return (await engine.generate([prompt], params))[0]

    sample = trio.run(served)
    tokens, logprobs = reference_greedy(out / "weights", prompt, 4, python=find_vllm_python())
    assert list(sample.response_tokens) == tokens
    np.testing.assert_allclose(sample.rollout_logprobs, logprobs, rtol=0, atol=1e-4)


def test_vllm_and_the_trainer_describe_the_same_truncated_distribution(tiny_run_inputs, vllm_for_tiny_model):
    """The engine (started by the launcher with processed log-probs) samples at T = 0.7, top_p = 0.9,
    top_k = 20; the trainer, given the same settings, computes log-probs of the same distribution:
    mean |trainer - engine| over the sampled tokens <= 1e-3."""
    from rollouts.backends import build_components, compute_logprobs, load_hf_model
    from rollouts.data import pack_samples
    from rollouts.types import OptimizerConfig

    model_dir = tiny_run_inputs / "model"
    params = SamplingParams(n=4, max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=20, seed=7, logprobs=True)

    async def sample():
        async with VLLMEngine(vllm_for_tiny_model.url, timeout_s=60.0) as engine:
            version = (await engine.weight_version() or 0) + 1
            await engine.update_weights_from_disk(str(model_dir), version)  # the weights the trainer loads
            return await engine.generate([[3, 4, 5, 6], [7, 8]], params)

    samples = trio.run(sample)
    components = build_components(load_hf_model(model_dir), OptimizerConfig(), num_training_steps=1)
    diffs = []
    for s in samples:
        (lp,) = compute_logprobs(components, pack_samples([s], max_tokens=64), temperature=0.7, top_k=20, top_p=0.9)
        trainer = lp[0, s.num_prompt_tokens : len(s.tokens)]
        diffs.extend(abs(float(a) - float(b)) for a, b in zip(trainer, s.rollout_logprobs, strict=True))
    assert sum(diffs) / len(diffs) <= 1e-3, (sum(diffs) / len(diffs), max(diffs))


async def _requests_running(url):
    """vLLM's own gauge of the requests it is decoding now (its /metrics)."""
    import httpx

    async with httpx.AsyncClient(timeout=10.0) as client:
        text = (await client.get(f"{url}/metrics")).text
    values = [
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running")
    ]
    return sum(values)


def test_vllm_responses_aborted_by_a_sync_are_kept_and_continued(tiny_run_inputs, vllm_for_tiny_model):
    """A sync (a pause in mode 'abort') lands while vLLM decodes: the responses come back partial
    (their tokens and log-probs so far, with the old version), and continue_partials finishes them
    under the new one: nothing lost, nothing repeated, each token's version recorded."""
    import dataclasses

    from rollouts.sync.partial import continue_partials, token_versions

    model_dir, url = str(tiny_run_inputs / "model"), vllm_for_tiny_model.url
    # Enough decoding (512 sequences to the 64-token context) that it outlasts the gap between vLLM's
    # running gauge turning positive and the sync's pause reaching the server (40 tokens x 64
    # sequences could finish inside that gap in a clean CI run).
    budget = 56
    prompts = [[3 + i % 10, 4 + i % 7, 5] for i in range(64)]
    params = SamplingParams(n=8, max_new_tokens=budget, temperature=1.0, seed=1, logprobs=True)

    async def run():
        async with VLLMEngine(url, timeout_s=60.0, keep_partial=True, pause_mode="abort") as engine:
            version = (await engine.weight_version() or 0) + 1
            await engine.update_weights_from_disk(model_dir, version)
            for _ in range(5):  # a batch done before the sync reached it has nothing to abort: again
                got = {}

                async def generate(got=got):
                    got["samples"] = await engine.generate(prompts, params)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(generate)
                    with trio.fail_after(60):
                        while not await _requests_running(url) and "samples" not in got:
                            await trio.sleep(0.005)
                    await engine.update_weights_from_disk(model_dir, version + 1)  # pauses in mode abort
                partial = [s for s in got["samples"] if s.metadata.get("partial")]
                if partial:
                    break
                version += 1
            done = await continue_partials(engine, partial, dataclasses.replace(params, n=1))
            return partial, done, version

    partial, done, old = trio.run(run)
    assert partial, "no response was in flight when the sync paused vLLM in 5 tries"
    for p, s in zip(partial, done, strict=True):
        assert p.status.value == "aborted" and p.weight_version == old
        assert len(p.rollout_logprobs) == p.response_length < budget
        assert s.tokens[: len(p.tokens)] == p.tokens  # the partial response kept, continued from its end
        k, rest = p.response_length, s.response_length - p.response_length
        assert rest >= 1 and token_versions(s) == (old,) * k + (old + 1,) * rest
        assert s.weight_version == (old if k else old + 1)  # the oldest version among its tokens
        assert len(s.rollout_logprobs) == s.response_length
        assert s.response_length == budget or s.status.value == "completed"  # the budget, unless EOS ended it
        assert "partial" not in s.metadata


def test_rl_loop_with_partial_rollouts_on_vllm(tiny_run_inputs, vllm_for_tiny_model, tmp_path):
    """rl.rollout.partial against the real server: each sync pauses vLLM in mode 'abort' while the
    next batch decodes; whatever it cuts short is continued, and every step trains a full batch of
    samples at most one version old, their version segments summing to their responses."""
    out = tmp_path / "rl_vllm_partial"
    engine = f"""
[engine]
kind = "vllm"
urls = ["{vllm_for_tiny_model.url}"]
timeout_s = 60.0
"""
    config = rl_toml(tiny_run_inputs, out, tiny_run_inputs / "model", extra=engine)
    settings = ["rl.overlap=true", "rl.rollout.partial=true", "rl.rollout.sampling.max_new_tokens=48"]
    settings += ["rl.rollout.batch_size=8", "rl.rollout.samples_per_prompt=8"]  # decoding outlasts training
    args = ["rl", "--config", str(config), "--set", "rl.rollout.request_timeout_s=60.0"]
    assert main([*args, *(a for s in settings for a in ("--set", s))]) == 0
    records = read_jsonl(out / "metrics_rl.jsonl")
    assert [r["weight_version"] for r in records] == [1.0, 2.0, 3.0]
    assert all(r["num_samples"] == 64 and r["num_trained"] == 64 and r["staleness_max"] <= 1 for r in records)
    assert all(r["groups_requested"] >= 8 + r["groups_partial"] for r in records)  # a group cut short is asked again


def _vllm_prompt_tokens(url):
    """The prompt tokens vLLM has taken in so far (its own counter, on /metrics)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:prompt_tokens_total")
    )


def _wait_until_vllm_decodes(url, prompt_tokens_before, num_tokens, timeout_s):
    """From a worker thread: until vLLM has taken in `num_tokens` prompt tokens beyond
    `prompt_tokens_before` (a counter, so no poll can miss it; vLLM counts a prompt once prefilled,
    its first token decoded); False if not within timeout_s."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _vllm_prompt_tokens(url) >= prompt_tokens_before + num_tokens:
            return True
        time.sleep(0.005)  # polling the server's counter: no timing is assumed, only its event
    return False


def test_a_sync_lands_mid_decode_in_the_rl_loop_and_the_aborted_responses_are_continued(
    tiny_run_inputs, vllm_for_tiny_model, tmp_path, monkeypatch
):
    """The RL loop (overlap, rl.rollout.partial) on the real server, the sync made to land while vLLM
    decodes the next batch: each step's training waits (an event: vLLM's own prompt-token counter)
    until half that batch's 512 sequences are in, so the sync's pause in mode 'abort' cuts it short.
    The next step trains samples continued across the abort: tokens of two weight versions, every
    token's log-prob kept. Training is recorded, not done (it would only widen the window the decode
    must outlast)."""
    import threading

    import rollouts.loops.step as step_module
    from rollouts.backends import build_components, load_hf_model
    from rollouts.data import AsyncRolloutManager, DataBuffer
    from rollouts.loops.loggers import NullLogger
    from rollouts.loops.rl import run_rl_training
    from rollouts.sync.partial import token_versions
    from rollouts.types import CheckpointConfig, OptimizerConfig, RLConfig, RolloutConfig

    url, num_steps, budget = vllm_for_tiny_model.url, 6, 56  # 3-token prompts: 59 of the 64-token context
    trained, waited = {}, []
    before = {b: [threading.Event(), None] for b in range(num_steps)}  # vLLM's prompt tokens as batch b began
    generate_batch = AsyncRolloutManager.generate_batch

    async def counted_generate_batch(self, *, step, **kw):
        before[step][1] = await trio.to_thread.run_sync(_vllm_prompt_tokens, url)  # the batch before is done
        before[step][0].set()
        return await generate_batch(self, step=step, **kw)

    def recording_update(components, state, samples, config, **_):
        trained[state.step] = list(samples)
        if state.step + 1 < num_steps:  # the next batch is generating: hold the sync until vLLM decodes it
            began = before[state.step + 1][0]
            # half the batch's prompts in (256 sequences x 3 tokens): far more than a batch just ended
            # can still add to the counter, and all of them decoding, the longest for ~55 more tokens
            taken_in = began.wait(60.0) and _wait_until_vllm_decodes(url, before[state.step + 1][1], 768, 60.0)
            waited.append(taken_in)
        return state.after_step(num_tokens=1, num_samples=len(samples)), {}

    monkeypatch.setattr(AsyncRolloutManager, "generate_batch", counted_generate_batch)
    monkeypatch.setattr(step_module, "rl_update", recording_update)
    config = RLConfig(
        num_steps=num_steps,
        overlap=True,
        max_tokens_per_micro_batch=64,
        checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
        rollout=RolloutConfig(
            batch_size=64,
            samples_per_prompt=8,
            partial=True,
            max_concurrency=64,  # every group at once: 512 sequences decoding together
            request_timeout_s=120.0,
            sampling=SamplingParams(max_new_tokens=budget, temperature=1.0, seed=1, logprobs=True),
        ),
        optimizer=OptimizerConfig(schedule="constant"),
    )
    model = load_hf_model(tiny_run_inputs / "model")
    metrics = {}

    engine = VLLMEngine(url, timeout_s=120.0, keep_partial=True, pause_mode="abort")
    run_rl_training(
        build_components(model, config.optimizer, num_training_steps=num_steps),
        DataBuffer([{"prompt": f"p{i}", "id": i} for i in range(64 * num_steps)], shuffle=False),
        engine,
        config,
        reward=lambda s, r: float(s.response_length % 2),
        encode_prompt=lambda r: [3 + r["id"] % 10, 4 + r["id"] % 7, 5],
        logger=NullLogger(),
        run_dir=tmp_path,
        on_step=lambda state, m: metrics.__setitem__(state.step, m),
    )
    assert waited == [True] * (num_steps - 1), "vLLM never decoded the next batch while a step trained"
    assert [metrics[b + 1]["weight_version"] for b in range(num_steps)] == [float(b + 1) for b in range(num_steps)]
    for b in range(1, num_steps):  # batch b decoded during step b-1's training, and its sync came
        samples = trained[b]
        assert len(samples) == 512 and metrics[b + 1]["num_trained"] == 512 and metrics[b + 1]["num_too_stale"] == 0
        assert all(b - s.weight_version <= 1 for s in samples if s.weight_version is not None)
        assert all(
            sum(n for _, n in s.metadata.get("version_segments", [[0, s.response_length]])) == s.response_length
            for s in samples
        )
    # The first sync also pays the first export's one-time setup (seconds, longer than a decode), so
    # it may come after the batch is done; a later one lands while vLLM decodes (a few hundred ms
    # after half the batch's prompts are in, against seconds of decoding), with versions known on
    # both sides of the abort. A sync can still meet a server done early (a batch whose responses
    # all hit EOS soon): of the four such syncs, at least one must have cut responses short.
    cut_steps = []
    for b in range(2, num_steps):
        continued = [s for s in trained[b] if len(s.metadata.get("version_segments", ())) == 2]
        if continued:
            cut_steps.append(b)
            assert metrics[b + 1]["groups_partial"] >= 1
        for s in continued:
            (v0, k), (v1, rest) = s.metadata["version_segments"]
            assert (v0, v1) == (b - 1, b) and k >= 1 and rest >= 1 and k + rest == s.response_length
            assert token_versions(s) == (b - 1,) * k + (b,) * rest and len(s.rollout_logprobs) == s.response_length
            assert s.weight_version == b - 1  # the oldest: staleness 1 at step b
            assert s.status.value in ("completed", "truncated") and "partial" not in s.metadata
    timings = {b: {k: metrics[b + 1][k] for k in ("generate_s", "sync_s", "groups_partial")} for b in range(num_steps)}
    assert cut_steps, f"no sync cut a response short: {timings}"
