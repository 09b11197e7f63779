"""The Python front door: `rollouts.loops.train` runs a run file (path or mapping) as the CLI does and
returns the final state and metrics; RLModels reads engine sharing off an in-process engine."""

import copy
import tomllib

import pytest
from run_configs import rl_toml

from rollouts.backends import InProcessEngine, build_components, load_hf_model
from rollouts.loops import RLModels, RunResult, train
from rollouts.loops.app.config import ConfigError
from rollouts.loops.engines.coalescing import CoalescingEngine
from rollouts.types import OptimizerConfig


def test_train_runs_a_path_and_a_mapping_and_returns_state_and_metrics(tiny_run_inputs, tmp_path):
    path = rl_toml(tiny_run_inputs, tmp_path / "from_path", tiny_run_inputs / "model")
    result = train(path, sets=["rl.num_steps=2"])
    assert isinstance(result, RunResult) and result.command == "rl"
    assert result.state.step == 2 and [h["step"] for h in result.history] == [1, 2]
    assert 0.0 <= result.metrics["reward_mean"] <= 1.0
    assert (result.checkpoints / "step_2" / "state.json").is_file()

    table = tomllib.loads(path.read_text())
    table["run"]["out_dir"] = str(tmp_path / "from_mapping")
    again = train(table, sets=["rl.num_steps=2"])
    assert again.state.step == 2 and again.run_dir == tmp_path / "from_mapping"
    with pytest.raises(ConfigError, match=r"<mapping>.*num_steps"):
        train(table, sets=["rl.num_steps=0"])
    with pytest.raises(TypeError, match="config must be a TOML path, a mapping or an RLRun / SFTRun, got int"):
        train(3)


def test_rl_models_reads_engine_sharing_off_the_engine(tiny_run_inputs):
    model = load_hf_model(tiny_run_inputs / "model")
    policy = build_components(model, OptimizerConfig(), num_training_steps=1)
    shared = CoalescingEngine(InProcessEngine(model), max_prompts_per_call=2)
    assert RLModels(policy=policy, engine=shared).engine_shares_model is True
    own = InProcessEngine(copy.deepcopy(model), shares_training_model=False)
    assert RLModels(policy=policy, engine=own).engine_shares_model is False
    with pytest.raises(ValueError, match=r"engine_shares_model=True, but the InProcessEngine samples from a model"):
        RLModels(policy=policy, engine=own, engine_shares_model=True)
    with pytest.raises(ValueError, match=r"shares_training_model=True\) samples from a model of its own.*never"):
        RLModels(policy=policy, engine=InProcessEngine(copy.deepcopy(model)))
