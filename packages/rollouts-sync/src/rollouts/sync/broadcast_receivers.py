"""Each engine's side of the broadcast transport's HTTP control calls: how many workers join, the
join, and a sync's receive (vLLM through the worker extension over /collective_rpc, SGLang through
its native /init_weights_update_group and /update_weights_from_distributed). Torch-free: the
trainer's torch half, rollouts.sync.broadcast, drives them.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any, Protocol

import anyio

from rollouts.sync._http import EngineError, RetryPolicy
from rollouts.sync.broadcast_wire import BroadcastOptions, BroadcastPlan, sglang_prefixes
from rollouts.sync.fingerprint import check_attestation
from rollouts.sync.sglang import SGLangEngine
from rollouts.sync.vllm import VLLMEngine

_NO_RETRY = RetryPolicy(max_retries=0)  # a retried receive would join a broadcast already under way


class BroadcastReceiver(Protocol):
    """One engine's side of the control calls: how many workers join, the join, and a sync."""

    @property
    def name(self) -> str: ...

    layout: str
    """"flat" (one buffer per bucket) or "tensors" (one broadcast per tensor)."""
    takes_adapters: bool
    """Whether `receive` takes a LoRA adapter (its tensors and `adapter_config`) to serve beside the base."""

    async def num_workers(self) -> int: ...

    def store_prefixes(self, group: str, backend: str) -> tuple[str, ...]:
        """Where the engine's workers keep group `group`'s keys in the trainer's store, outermost first."""
        ...

    async def join(self, *, host: str, port: int, group: str, world_size: int, options: BroadcastOptions) -> None: ...

    def paused(self) -> Any:
        """An async context manager: generation paused for its body, resumed after it."""
        ...

    async def receive(
        self, plan: BroadcastPlan, options: BroadcastOptions, adapter_config: str | None = None
    ) -> list[dict[str, int]] | None:
        """Receive `plan`'s buckets and load them (the caller broadcasts them meanwhile); under paused().
        With `adapter_config` (PEFT's adapter_config.json), the tensors are a LoRA adapter's, kept for
        `finish` to serve. Returns each worker's checksums of what it received (None: it reports none);
        attested (`options.attest`), a receiver that reports them holds full weights unloaded until
        `finish` loads them, or `reject` drops them."""
        ...

    async def finish(self, weight_version: int) -> None:
        """After a successful receive, under paused(): load what it holds, drop cached prefixes and
        record the version (after an adapter's receive: load the adapter and serve it)."""
        ...

    async def reject(self) -> None:
        """After a receive whose checksums disagree with the trainer's, or a sync that failed after its
        receive began, under paused(): drop what it holds, unloaded (the engine goes on serving the
        weights it had). Best effort and bounded; raises nothing but a cancellation."""
        ...

    async def check_version(self, weight_version: int) -> None: ...


def _refused(engine: str, path: str, message: str, text: object) -> EngineError:
    """An engine's answer of 200 that says the call failed, as an EngineError naming it and the path."""
    return EngineError(f"{engine}: {message}", engine=engine, url=f"{engine}{path}", status=200, text=str(text))


ENGINE_WAIT_FACTOR = 2
"""A vLLM worker's bound on each piece, in the trainer's `bucket_timeout_s`: the trainer sends each
piece to the engines in turn, so an engine waits for the piece while the trainer waits, up to its
bound, on an engine before it that stalls; waiting longer, the healthy engine gets its piece then."""


def receive_timeout_s(plan: BroadcastPlan, options: BroadcastOptions) -> float:
    """Bound on one receive call: every bucket at the workers' bound, then the load at its own."""
    return len(plan.buckets) * ENGINE_WAIT_FACTOR * options.bucket_timeout_s + options.load_timeout_s


class VLLMReceiver:
    """vLLM's side: the worker extension's rollouts_init_broadcast / rollouts_receive_broadcast
    methods, called over /collective_rpc (every worker of the server runs them)."""

    layout = "flat"
    takes_adapters = True

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine
        self._adapter_path: str | None = None  # where the workers wrote the adapter the last receive took
        self._held: tuple[str, float] | None = None  # what the workers may hold: its token, the load's bound
        self._adapter_token = secrets.token_hex(8)  # names the workers' adapter directory: unguessable

    @property
    def name(self) -> str:
        return self.engine.name

    async def _rpc(self, method: str, kwargs: dict[str, str], timeout_s: float) -> list[Any]:
        body = {"method": method, "kwargs": kwargs, "timeout": timeout_s}
        response = await self.engine._call("POST", "/collective_rpc", json=body, timeout_s=timeout_s, retry=_NO_RETRY)
        data = self.engine._json_or_empty(response)
        results = data.get("results") or []
        for result in results:
            if isinstance(result, dict) and result.get("error"):
                raise _refused(self.name, "/collective_rpc", f"{method} failed: {result['error']}", result["error"])
        return list(results)

    async def num_workers(self) -> int:
        return len(await self._rpc("rollouts_broadcast_rank", {}, self.engine.timeout_s))

    def store_prefixes(self, group: str, backend: str) -> tuple[str, ...]:
        del backend  # the worker extension joins as broadcast_group.join_group does by default
        return (f"{group}/",)

    async def join(self, *, host: str, port: int, group: str, world_size: int, options: BroadcastOptions) -> None:
        kwargs = {
            "host": host,
            "port": str(port),
            "group": group,
            "rank_offset": "1",
            "world_size": str(world_size),
            "backend": options.backend,
            "setup_timeout_s": str(options.setup_timeout_s),
            "bucket_timeout_s": str(ENGINE_WAIT_FACTOR * options.bucket_timeout_s),
        }
        await self._rpc("rollouts_init_broadcast", kwargs, options.setup_timeout_s)

    def paused(self) -> Any:
        return self.engine._paused("/pause", "/resume", params={"mode": self.engine.pause_mode})

    async def receive(
        self, plan: BroadcastPlan, options: BroadcastOptions, adapter_config: str | None = None
    ) -> list[dict[str, int]] | None:
        self._adapter_path, self._held = None, None
        if adapter_config is None:
            plan_json = plan.to_json(checksums=options.attest, stage=options.stage)
            kwargs, method = {"plan_json": plan_json}, "rollouts_receive_broadcast"
            if options.attest:  # held until the trainer compared the checksums (unattested: loaded at once)
                self._held = (secrets.token_hex(8), options.load_timeout_s)
                kwargs["hold"] = self._held[0]
        else:
            method = "rollouts_receive_adapter"
            plan_json = plan.to_json(checksums=options.attest, stage=options.stage)
            kwargs = {"plan_json": plan_json, "config_json": adapter_config, "token": self._adapter_token}
        results = [r for r in await self._rpc(method, kwargs, receive_timeout_s(plan, options)) if isinstance(r, dict)]
        if adapter_config is not None:
            paths = sorted({str(r.get("path")) for r in results})
            if len(paths) != 1:  # every worker must load the same files
                raise _refused(
                    self.name, "/collective_rpc", f"its workers wrote the adapter at {paths}, expected one path", paths
                )
            self._adapter_path = paths[0]
        return [dict(r.get("checksums") or {}) for r in results]

    async def finish(self, weight_version: int) -> None:
        if self._adapter_path is not None:  # the adapter the workers wrote: vLLM loads it from there
            await self.engine.activate_adapter(self._adapter_path, weight_version)
            return
        if self._held is not None:  # attested: loaded now
            token, load_timeout_s = self._held
            await self._rpc("rollouts_commit", {"token": token}, load_timeout_s)
            self._held = None
        await self.engine.reset_prefix_cache()
        await self.engine._call("POST", "/update_weight_version", json={"new_version": str(weight_version)})
        self.engine._adapter = None  # full weights: the base model serves again

    async def reject(self) -> None:
        held, self._held, self._adapter_path = self._held, None, None
        if held is not None:
            await self.engine._discard_held(held[0])

    async def check_version(self, weight_version: int) -> None:
        await self.engine._check_version(weight_version)


class SGLangReceiver:
    """SGLang's side: its native /init_weights_update_group and /update_weights_from_distributed
    (every tensor of the plan in one call, so SGLang loads only once all of them arrived)."""

    layout = "tensors"
    takes_adapters = False  # SGLang loads a LoRA adapter from a path

    def __init__(self, engine: SGLangEngine) -> None:
        self.engine = engine
        self._group = ""
        self._sessions: bool | None = None  # whether the server has weight-update sessions (None: not asked)

    @property
    def name(self) -> str:
        return self.engine.name

    async def _post(self, path: str, body: dict[str, Any], timeout_s: float, *, needs_success: bool = True) -> None:
        """POST `body`; an answer without success=true is an EngineError (`needs_success=False`: only
        an answer of success=false is)."""
        response = await self.engine._call("POST", path, json=body, timeout_s=timeout_s, retry=_NO_RETRY)
        data = response.json() if response.content else {}
        data = data if isinstance(data, dict) else {"message": str(data)[:500]}
        if not data.get("success", not needs_success):
            raise _refused(self.name, path, f"{path} failed: {data.get('message')}", data.get("message"))

    async def num_workers(self) -> int:
        info = (await self.engine._call("GET", "/get_server_info")).json()
        return int(info.get("tp_size") or 1)

    def store_prefixes(self, group: str, backend: str) -> tuple[str, ...]:
        return sglang_prefixes(group, backend)

    async def join(self, *, host: str, port: int, group: str, world_size: int, options: BroadcastOptions) -> None:
        body = {
            "master_address": host,
            "master_port": port,
            "rank_offset": 1,
            "world_size": world_size,
            "group_name": group,
            "backend": options.backend,
        }
        previous, self.engine._broadcast_group = self.engine._broadcast_group, ""
        if previous:  # its communicator (on NCCL, GPU memory) is released before a new one is made
            try:
                await self._post("/destroy_weights_update_group", {"group_name": previous}, options.setup_timeout_s)
            except EngineError:
                pass  # broken with the trainer that made it, or gone with a restart: nothing to release
        await self._post("/init_weights_update_group", body, options.setup_timeout_s)
        self._group = self.engine._broadcast_group = group

    def paused(self) -> Any:
        return self.engine.paused()

    async def receive(
        self, plan: BroadcastPlan, options: BroadcastOptions, adapter_config: str | None = None
    ) -> list[dict[str, int]] | None:
        if adapter_config is not None:
            raise ValueError(f"{self.name} (SGLang) takes full weights only by broadcast")
        tensors = [t for bucket in plan.buckets for t in bucket]
        body = {
            "names": [t.name for t in tensors],
            "dtypes": [t.dtype for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": self._group,
            "flush_cache": True,
            "weight_version": str(plan.weight_version),
        }
        in_session = await self._begin_session(options)
        try:
            await self._post("/update_weights_from_distributed", body, receive_timeout_s(plan, options))
        except BaseException:
            if in_session:  # closed, or the next sync's session would be refused; this error is the one raised
                with anyio.CancelScope(shield=True), anyio.move_on_after(options.setup_timeout_s):
                    try:
                        await self._post("/end_weight_update", {}, options.setup_timeout_s, needs_success=False)
                    except EngineError:
                        pass
            raise
        if in_session:
            await self._post("/end_weight_update", {}, options.setup_timeout_s, needs_success=False)
        return None  # SGLang reports no checksums of what it loaded

    async def _begin_session(self, options: BroadcastOptions) -> bool:
        """Open a weight-update session where the server has them (SGLang 0.5.23 refuses an update
        outside one); False for a server without (a 404: it loads without a session)."""
        if self._sessions is False:
            return False
        try:
            await self._post("/begin_weight_update", {}, options.setup_timeout_s, needs_success=False)
        except EngineError as e:
            if e.status != 404:
                raise
            self._sessions = False
            return False
        self._sessions = True
        return True

    async def finish(self, weight_version: int) -> None:
        del weight_version  # SGLang records it and flushes its cache within the update itself

    async def reject(self) -> None:
        """Nothing to drop: SGLang loads within its receive (and reports no checksums to check first)."""

    async def check_version(self, weight_version: int) -> None:
        got = await self.engine.weight_version()
        if got != weight_version:
            raise _refused(
                self.name, "/get_weight_version", f"weight version reads {got!r} after setting {weight_version}", got
            )


def receiver_for(engine: object) -> BroadcastReceiver:
    """The receiver for a VLLMEngine or an SGLangEngine (or a wrapper exposing one as `.engine`)."""
    inner = engine
    for _ in range(4):  # wrappers (BoundedSync, SendWeights, ...) hold the client as .engine
        if isinstance(inner, (VLLMEngine, SGLangEngine)):
            break
        inner = getattr(inner, "engine", None)
    if isinstance(inner, VLLMEngine):
        return VLLMReceiver(inner)
    if isinstance(inner, SGLangEngine):
        return SGLangReceiver(inner)
    raise TypeError(
        f"the broadcast transport reaches vLLM and SGLang servers only (VLLMEngine, SGLangEngine), "
        f"got {type(engine).__name__}"
    )


def check_reported(
    receiver: BroadcastReceiver, expected: Mapping[str, int], reported: list[dict[str, int]], version: int
) -> None:
    """AttestationError unless every worker's checksums equal `expected` (no worker answering is one)."""
    for checksums in reported or [{}]:
        check_attestation(expected, checksums, engine=receiver.name, weight_version=version)
