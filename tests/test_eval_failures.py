"""A periodic evaluation that fails never costs trained steps: the step's metrics and checkpoint are
written, the failure is logged and counted (eval_failed), and the run stops only when asked to."""

import pytest

from rollouts.backends import InProcessEngine, build_components, latest_checkpoint
from rollouts.data import DataBuffer
from rollouts.loops.engines.coalescing import CoalescingEngine
from rollouts.loops.evaluation import Evaluation
from rollouts.loops.recipes.tiny import build_tiny_model
from rollouts.loops.rl.loop import RunOutputs, run_rl_training
from rollouts.loops.rl.models import RLModels
from rollouts.loops.run.loggers import JsonlLogger, read_jsonl
from rollouts.types import CheckpointConfig, OptimizerConfig, RLConfig, RolloutConfig, SamplingParams

_EVAL_MARK = 9  # the token that starts every evaluation prompt (training prompts never hold it)


class FailsOnEvaluation:
    """An engine whose requests for evaluation prompts fail, as a server that errs mid-run would."""

    def __init__(self, inner):
        self.inner = inner
        self.name = "flaky"

    async def generate(self, prompts, params):
        if any(p[0] == _EVAL_MARK for p in prompts):
            raise ConnectionError("engine flaky dropped the connection")
        return await self.inner.generate(prompts, params)

    async def weight_version(self):
        return await self.inner.weight_version()

    async def health(self):
        return True

    async def update_weights_from_disk(self, path, weight_version):
        await self.inner.update_weights_from_disk(path, weight_version)


def _run(tmp_path, *, stop_on_error):
    model = build_tiny_model(32, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    config = RLConfig(
        num_steps=2,
        max_tokens_per_micro_batch=64,
        rollout=RolloutConfig(batch_size=2, samples_per_prompt=2, sampling=SamplingParams(max_new_tokens=3, seed=0)),
        optimizer=OptimizerConfig(schedule="constant", lr=1e-3),
        checkpoint=CheckpointConfig(every_steps=1, keep_last=2),
    )
    components = build_components(model, config.optimizer, num_training_steps=2)
    engine = FailsOnEvaluation(CoalescingEngine(InProcessEngine(model, shares_training_model=True, eos_token_ids=())))
    evaluation = Evaluation(
        records=({"prompt": "e", "eval": True},),
        every_steps=1,
        sampling=SamplingParams(max_new_tokens=3, temperature=0.0),
        stop_on_error=stop_on_error,
    )
    return run_rl_training(
        RLModels(policy=components, engine=engine, engine_shares_model=True),
        DataBuffer([{"prompt": f"p{i}", "id": i} for i in range(8)], shuffle=False),
        config,
        reward=lambda sample, record: float(sample.tokens[-1] % 2),
        encode_prompt=lambda r: [_EVAL_MARK, 4] if r.get("eval") else [3 + r["id"], 4],
        output=RunOutputs(run_dir=tmp_path, logger=JsonlLogger(tmp_path / "metrics.jsonl")),
        evaluation=evaluation,
    )


def test_a_failed_evaluation_is_counted_and_the_run_goes_on(tmp_path, caplog):
    state, history = _run(tmp_path, stop_on_error=False)
    assert state.step == 2 and [m["eval_failed"] for m in history] == [1.0, 1.0]
    assert "evaluation failed at step 1: ConnectionError: engine flaky dropped the connection" in caplog.text
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_2"


def test_a_run_told_to_stop_on_a_failed_evaluation_stops_after_saving_the_step(tmp_path):
    with pytest.raises(ConnectionError, match="dropped the connection"):
        _run(tmp_path, stop_on_error=True)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1]  # the step's metrics line
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_1"  # and its checkpoint
