"""The rollout of examples/tool_use.toml: multi-turn episodes with a calculator tool.

Each model turn either calls the tool, `calc: 12*7`, and sees `= 84`, or answers, `answer: 84`,
which ends the episode with reward 1.0 when right. Tool output is appended to the context with loss
weight 0, so only the model's own tokens are trained. Write your own environment the same way: an
object with reset(record) -> first text and step(text, ids) -> EnvStep (rollouts.types).
"""

from rollouts.loops import CalculatorEnv, environment_rollout

rollout = environment_rollout(CalculatorEnv, max_turns=3, max_total_tokens=1024, step_timeout_s=10.0)
