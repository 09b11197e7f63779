"""The agent of examples/agent.toml: a two-turn calculator task, written against the OpenAI client.

`rollouts` gives each episode its own OpenAI-compatible base URL in front of the model being
trained; the agent is an ordinary program that talks to it. Turn 1 asks the model for an arithmetic
expression, the agent runs it on a calculator (its tool) and appends the result as a user message;
turn 2 asks for the final answer. The return value is the episode's reward (None would leave it to
the run's [reward] fn). Needs `pip install openai`.
"""

from openai import AsyncOpenAI

from rollouts.loops.rollouts.environments import safe_arithmetic


async def run(base_url: str, record: dict) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60.0)
    messages = [{"role": "user", "content": f"{record['prompt']}\nReply with one arithmetic expression."}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=32)
    expression = first.choices[0].message.content or ""
    try:
        result = str(safe_arithmetic(expression.strip().rstrip("=")))
    except ValueError as e:
        result = f"error: {e}"
    messages += [
        {"role": "assistant", "content": expression},
        {"role": "user", "content": f"calculator: {result}\nReply with the final answer only."},
    ]
    final = await client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
    answer = (final.choices[0].message.content or "").strip()
    return 1.0 if answer == str(record["answer"]).strip() else 0.0
