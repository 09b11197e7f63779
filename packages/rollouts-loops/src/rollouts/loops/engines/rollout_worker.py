"""The engine process behind RolloutProcess: `python -m rollouts.loops.engines.rollout_worker ...`.

It is ProcessEngine's engine process (rollouts.backends.engine_process.worker: the same command line, the
same requests, answered the same way) that also runs the run's rollout manager, so the trainer's
process only receives each step's finished batch. Requests beside the engine's:

- "rollouts_configure": the header's "spec" (what `rollout_process.rollout_spec` writes) and the
  prompt records as JSON lines in the body; builds the DataBuffer and the rollout manager, over a
  CoalescingEngine of this process's own sampler;
- "rollouts_batch": {"step", "train_version"} -> that step's RolloutBatch (rollouts.types.wire bytes);
- "rollouts_state" -> {"state": the manager's state_dict}; "rollouts_load_state": {"buffer", "manager"}
  (state_dicts). The buffer's position also comes with each batch ({"buffer": ...}).

One request at a time, in order: a weight load sent after a batch request waits for that batch,
as the loop's engine lock has a sync wait for the generation in flight. The engine's request loop
(rollouts.backends.engine_process.worker.serve) runs in a thread of its own; the rollout manager's
requests run back on this process's trio loop, where the manager and its engine live.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import trio

from rollouts.backends.engine_process.worker import (
    EngineWorker,
    Handler,
    handlers_of,
    parser,
    serve,
    serve_swept,
    start_worker,
)
from rollouts.data import AsyncRolloutManager, DataBuffer, prompt_encoder
from rollouts.loops.engines.coalescing import CoalescingEngine
from rollouts.loops.engines.rollout_process import load_function, records_from_jsonl
from rollouts.loops.rollouts.functions import RolloutContext, rollout_manager, single_turn_rollout
from rollouts.loops.rollouts.scoring import Reward
from rollouts.types import RLConfig, Sample, SamplingParams, from_dict
from rollouts.types.wire import batch_to_bytes


class _LocalEngine:
    """This process's sampler, as the rollout manager's engine: a SyncSampler (the CoalescingEngine
    around it runs `sample` in a worker thread) and an InferenceEngine."""

    def __init__(self, worker: EngineWorker, name: str) -> None:
        self._worker, self._name = worker, name

    @property
    def name(self) -> str:
        return self._name

    def sample(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int | None] | None = None
    ) -> list[Sample]:
        return self._worker.sample(prompts, params, seeds)

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Sample]:
        return self.sample(prompts, params)

    async def weight_version(self) -> int | None:
        return self._worker.weight_version

    async def health(self) -> bool:
        return True

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        raise RuntimeError("the rollout process's weights are loaded through its own requests, not the manager's")


class _Rollouts:
    """The rollout manager this process runs, once configured."""

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker
        self.configured: tuple[AsyncRolloutManager, DataBuffer] | None = None

    def handlers(self) -> dict[str, Handler]:
        """This process's requests beside the engine's, each run on the trio loop (the request loop
        runs in a worker thread)."""
        return {
            "rollouts_configure": lambda header, body: trio.from_thread.run_sync(self.configure, header["spec"], body),
            "rollouts_batch": lambda header, _: trio.from_thread.run(self.batch, header),
            "rollouts_state": lambda header, _: trio.from_thread.run_sync(self.state, header),
            "rollouts_load_state": lambda header, _: trio.from_thread.run_sync(self.load_state, header),
        }

    def configure(self, spec: dict[str, Any], records: bytes) -> tuple[dict[str, Any], bytes]:
        sys.path.extend(p for p in spec["sys_path"] if p not in sys.path)  # the functions import as in the trainer
        config = from_dict(RLConfig, spec["config"])
        prompts = records_from_jsonl(records)
        buffer = DataBuffer(prompts, seed=spec["buffer"]["seed"], shuffle=spec["buffer"]["shuffle"])
        buffer.load_state_dict(spec["buffer"])
        encode = spec["encode"]
        if "fn" in encode:
            encode_prompt = load_function(encode["fn"], key="encode_prompt")
        else:
            if self.worker.tokenizer is None:
                raise ValueError("the prompt encoder needs the tokenizer: start the RolloutProcess with tokenizer=")
            encode_prompt = prompt_encoder(self.worker.tokenizer, field=encode["field"], chat=encode["chat"])
        engine = CoalescingEngine(
            _LocalEngine(self.worker, spec["engine_name"]), max_prompts_per_call=spec["max_prompts_per_call"]
        )
        context = RolloutContext(
            engine=engine,
            sampling=dataclasses.replace(config.rollout.sampling, n=config.rollout.samples_per_prompt),
            encode_prompt=encode_prompt,
            tokenizer=self.worker.tokenizer,
            vocab_size=spec["vocab_size"],
            max_sample_tokens=config.max_tokens_per_micro_batch,
        )
        reward = spec["reward"]
        manager = rollout_manager(
            buffer,
            config,
            single_turn_rollout if spec["rollout"] is None else load_function(spec["rollout"], key="rollout"),
            context,
            Reward(
                fn=load_function(reward["fn"], key="reward"),
                batched=reward["batched"],
                on_error=reward["on_error"],
                timeout_s=reward["timeout_s"],
            ),
            None if spec["filter_fn"] is None else load_function(spec["filter_fn"], key="filter_fn"),
        )
        self.configured = manager, buffer
        return {"ok": True}, b""

    async def batch(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        """The step's batch, and the buffer's position after it (the trainer's buffer follows it)."""
        manager, buffer = self._configured()
        batch = await manager.generate_batch(step=header["step"], train_version=header["train_version"])
        return {"ok": True, "buffer": buffer.state_dict()}, batch_to_bytes(batch)

    def state(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        manager, _ = self._configured()
        return {"ok": True, "state": manager.state_dict()}, b""

    def load_state(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        manager, buffer = self._configured()
        buffer.load_state_dict(header["buffer"])
        manager.load_state_dict(header["manager"])
        return {"ok": True}, b""

    def _configured(self) -> tuple[AsyncRolloutManager, DataBuffer]:
        if self.configured is None:
            raise RuntimeError("the rollout process has no rollout manager yet (no rollouts_configure request)")
        return self.configured


async def _serve(worker: EngineWorker, requests_fd: int, answers_fd: int) -> bool:
    """Answer requests, the engine's and the rollout manager's, until the pipe closes or "close";
    whether the parent went away."""
    handlers = {**handlers_of(worker), **_Rollouts(worker).handlers()}
    return await trio.to_thread.run_sync(serve, handlers, requests_fd, answers_fd)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    serve_swept(args.sweep, lambda: trio.run(_serve, start_worker(args), args.requests_fd, args.answers_fd))


if __name__ == "__main__":
    main()
