"""The RL loop against a real vLLM CPU server: rollouts from vLLM, weights synced back each step."""

import pytest
import trio
from run_configs import rl_toml

from rollouts.loops.app.cli import main
from rollouts.loops.loggers import read_jsonl
from rollouts.sync import VLLMEngine
from rollouts.sync.testing import find_vllm_python, launch_vllm_server, vllm_unavailable_reason

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def vllm_for_tiny_model(tiny_run_inputs, tmp_path_factory):
    reason = vllm_unavailable_reason()
    if reason is not None:
        pytest.skip(f"vLLM CPU server unavailable: {reason}")
    log = tmp_path_factory.mktemp("vllm_log") / "server.log"
    with launch_vllm_server(
        tiny_run_inputs / "model", python=find_vllm_python(), log_path=log, max_model_len=64
    ) as server:
        yield server


def test_rl_loop_with_vllm_engine_syncs_weights(tiny_run_inputs, vllm_for_tiny_model, tmp_path):
    out = tmp_path / "rl_vllm"
    engine = f"""
[engine]
kind = "vllm"
urls = ["{vllm_for_tiny_model.url}"]
timeout_s = 60.0
"""
    config = rl_toml(tiny_run_inputs, out, tiny_run_inputs / "model", extra=engine)
    assert main(["rl", "--config", str(config), "--set", "rl.rollout.request_timeout_s=60.0"]) == 0
    records = read_jsonl(out / "metrics_rl.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["weight_version"] for r in records] == [1.0, 2.0, 3.0]
    assert all(r["num_samples"] == 16 for r in records)

    async def served_version():
        async with VLLMEngine(vllm_for_tiny_model.url, timeout_s=30.0) as engine:
            return await engine.weight_version()

    assert trio.run(served_version) == 3
