"""The RL loop against a real vLLM CPU server: rollouts from vLLM, weights synced back each step."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import trio
from run_configs import rl_toml

from rollouts.loops.app.cli import main
from rollouts.loops.run.loggers import read_jsonl
from rollouts.sync import BroadcastOptions, HTTPOptions, VLLMEngine
from rollouts.sync.testing import find_vllm_python, reference_greedy
from rollouts.types import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


async def _served_version(url):
    async with VLLMEngine(url, http=HTTPOptions(timeout_s=30.0)) as engine:
        return await engine.weight_version()


@pytest.mark.parametrize("sync", ["disk", "ipc", "broadcast"])
def test_rl_loop_with_vllm_engine_syncs_weights(tiny_run_inputs, vllm_for_tiny_model, tmp_path, sync):
    """The trainer and the engine run in different working directories: "disk" sends an absolute path
    (a relative one was unreadable there), "ipc" (sync "http", http_wire "ipc") has vLLM's worker copy
    the model's tensors out of the trainer's memory (/dev/shm here; the default wire, "fetch", takes
    the same path in the loop, and has its own tests against vLLM in rollouts-sync), "broadcast"
    through a gloo group with vLLM's worker. The sync probe checks every step's sync."""
    out = tmp_path / "rl_vllm"
    wire = 'sync = "http"\nhttp_wire = "ipc"' if sync == "ipc" else f'sync = "{sync}"'
    engine = f"""
[engine]
kind = "vllm"
urls = ["{vllm_for_tiny_model.url}"]
timeout_s = 60.0
{wire}
"""
    config = rl_toml(tiny_run_inputs, out, tiny_run_inputs / "model", extra=engine)
    probe = ["--set", "rl.sync_probe_tokens=4"]
    assert main(["rl", "--config", str(config), "--set", "rl.rollout.request_timeout_s=60.0", *probe]) == 0
    records = read_jsonl(out / "metrics_rl.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["sync_probe_logprob_diff"] <= 1e-3 for r in records)  # each probe passed (else the run failed)
    assert [r["weight_version"] for r in records] == [1.0, 2.0, 3.0]
    assert all(r["num_samples"] == 16 for r in records)
    assert trio.run(_served_version, vllm_for_tiny_model.url) == 3
    # The engine serves the trained weights: greedy tokens and log-probs equal transformers' on the
    # run's last checkpoint (float32 on both sides).
    prompt = [3, 4, 5, 6]
    params = SamplingParams(max_new_tokens=4, temperature=0.0, logprobs=True)

    async def served():
        async with VLLMEngine(vllm_for_tiny_model.url, http=HTTPOptions(timeout_s=60.0)) as engine:
            return (await engine.generate([prompt], params))[0]

    sample = trio.run(served)
    assert (out / "weights").exists() == (sync == "disk")  # the others take the model's own tensors
    tokens, logprobs = reference_greedy(out / "checkpoints" / "step_3", prompt, 4, python=find_vllm_python())
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
        async with VLLMEngine(vllm_for_tiny_model.url, http=HTTPOptions(timeout_s=60.0)) as engine:
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
        async with VLLMEngine(url, http=HTTPOptions(timeout_s=60.0), keep_partial=True, pause_mode="abort") as engine:
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


GREEDY_4 = SamplingParams(max_new_tokens=4, temperature=0.0, logprobs=True)


def test_fsdp2_on_two_gloo_ranks_broadcasts_to_one_engine(tiny_run_inputs, vllm_for_tiny_model, tmp_path):
    """Each DTensor gathered bucket by bucket: the engine then serves exactly what it serves after a
    disk sync of the full weights the ranks gathered (greedy tokens and log-probs, bit for bit)."""
    version = (trio.run(_served_version, vllm_for_tiny_model.url) or 0) + 1
    worker = os.path.join(os.path.dirname(__file__), "broadcast_fsdp_worker.py")
    model, out = tiny_run_inputs / "model", tmp_path / "sent"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", worker]
    cmd += [str(model), vllm_for_tiny_model.url, str(out), str(version)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert trio.run(_served_version, vllm_for_tiny_model.url) == version

    async def served():
        async with VLLMEngine(vllm_for_tiny_model.url, http=HTTPOptions(timeout_s=60.0)) as engine:
            return (await engine.generate([[3, 4, 5, 6]], GREEDY_4))[0]

    broadcast = trio.run(served)
    trio.run(_disk_sync, vllm_for_tiny_model.url, str(out), version + 1)  # the same weights, from disk
    disk = trio.run(served)
    assert broadcast.response_tokens == disk.response_tokens
    np.testing.assert_array_equal(broadcast.rollout_logprobs, disk.rollout_logprobs)


async def _disk_sync(url, path, version):
    async with VLLMEngine(url, http=HTTPOptions(timeout_s=60.0)) as engine:
        await engine.update_weights_from_disk(path, version)


@pytest.fixture
def doomed_vllm(tiny_run_inputs, tmp_path):
    """A second vLLM server for the tiny model, to be killed mid-broadcast."""
    from rollouts.sync.testing import launch_vllm_server

    with launch_vllm_server(tiny_run_inputs / "model", max_model_len=64, log_path=tmp_path / "doomed.log") as server:
        yield server


def test_an_engine_killed_mid_broadcast_is_named_and_the_other_loads(
    tiny_run_inputs, vllm_for_tiny_model, doomed_vllm, tmp_path
):
    """SIGKILL to one server's process group between buckets: the push fails within the bucket bound
    naming that server, and the other server loads every bucket and serves the new version."""
    from rollouts.sync import WeightSyncError
    from rollouts.sync.broadcast import BroadcastSync

    bucket_timeout_s = 20.0

    class KillsBeforeBucket2(BroadcastSync):
        def _send_bucket(self, index, *args, **kwargs):
            if index == 2:
                os.killpg(doomed_vllm.pid, signal.SIGKILL)
            super()._send_bucket(index, *args, **kwargs)

    from safetensors.torch import load_file

    sent = {n: t.bfloat16() for n, t in load_file(str(tiny_run_inputs / "model" / "model.safetensors")).items()}

    async def run():
        http = HTTPOptions(timeout_s=60.0)
        async with (
            VLLMEngine(vllm_for_tiny_model.url, http=http) as good,
            VLLMEngine(doomed_vllm.url, http=http) as bad,
        ):
            version = max(await good.weight_version() or 0, await bad.weight_version() or 0) + 1
            sync = KillsBeforeBucket2(BroadcastOptions(bucket_bytes=8 * 1024, bucket_timeout_s=bucket_timeout_s))
            await sync.connect([good, bad])
            start = trio.current_time()
            with pytest.raises(WeightSyncError) as info:
                await sync.push(sent, version)
            elapsed = trio.current_time() - start
            return info.value, elapsed, good.name, bad.name, version, await good.weight_version()

    error, elapsed, good, bad, version, good_version = trio.run(run)
    assert elapsed < bucket_timeout_s + 30.0, elapsed  # the bound, with room for the survivor's load
    assert [f.engine for f in error.failures] == [bad] and error.updated == (good,), str(error)
    assert good_version == version
