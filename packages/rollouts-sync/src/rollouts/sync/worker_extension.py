"""vLLM worker extension: load weights sent as safetensors bytes, fetched raw from the trainer or in
a /collective_rpc body.

Start the server with `--worker-extension-cls rollouts.sync.worker_extension.SafetensorsWeightLoader`
(this module runs inside vLLM's worker process: standard library, torch, and of rollouts.sync only
fingerprint_torch, broadcast_group, worker_receive, worker_ipc and ipc_handles, which a server started
by rollouts.sync.launch gets as copies beside it; nothing in rollouts.sync imports this module).

Partial updates: a request may name only some checkpoint tensors. vLLM reloads a layer as a whole
(on CPU it repacks linear weights and drops the originals, and a fused qkv_proj is built from
q/k/v together), so the extension keeps the full checkpoint-format weights in host memory:
loaded once from the model directory the server last loaded, updated by each request, and fed
whole to vLLM's in-place `reload_weights`. Cost: one extra copy of the weights in host memory.

Raw fetch: `rollouts_fetch_weights` GETs one safetensors payload from the trainer's one-off URL
(rollouts.sync.raw_server) into one buffer: the tensors' own bytes, no base64, no JSON.

Host memory: a sync lands in a buffer kept between syncs (rollouts.sync.worker_receive), whose new
tensors the cache copies into its own once the reload succeeded, in a thread after the call answered
(on a GPU, the whole model's copy to the host); the next call needing the cache or buffer waits.

Each call answers "seconds": its own steps' durations (receive, checksum, load), for profiles.

Attestation: each load answers the checksums (rollouts.sync.fingerprint) of the tensors this worker
received, and `rollouts_fingerprint` those of the checkpoint files a disk reload read, computed here
in the worker. ROLLOUTS_SYNC_FAULT (see rollouts.sync.fingerprint) flips a bit of the named tensor
after receipt, for tests of the check.

Broadcast: `rollouts_init_broadcast` joins a process group made for the sync (a TCPStore client
of the trainer's store and a gloo or NCCL group on it; vLLM's own groups are never touched), and
`rollouts_receive_broadcast` receives a plan's flat buckets from the trainer (rank 0), then reloads
through the same path as `rollouts_load_weights`, only once every bucket arrived;
`rollouts_receive_adapter` receives a LoRA adapter's tensors the same way and writes them as an
adapter directory on this host, for vLLM's /v1/load_lora_adapter.

IPC: `rollouts_receive_ipc` (rollouts.sync.worker_ipc) copies buckets out of a local trainer's memory.

Held loads (an attested sync, rollouts.sync.worker_receive.HeldLoads): with hold=<token> a receive
answers its checksums and keeps the tensors unloaded until `rollouts_commit(token)` (reload with them)
or `rollouts_discard(token)`: weights that fail attestation are never loaded.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import load_file
from safetensors.torch import save as save_bytes

try:
    from rollouts.sync.broadcast_group import (
        close_group,
        connect_to_trainer,
        flat_views,
        read_plan,
        receive_flat_buckets,
    )
    from rollouts.sync.fingerprint_torch import fingerprint_torch, with_sync_fault
    from rollouts.sync.worker_ipc import IpcWeightReceiver
    from rollouts.sync.worker_receive import (
        ChecksumsOnArrival,
        ReceiveBuffer,
        fetch_bytes,
        files_signature,
        keep_in_cache,
        keep_newest,
        read_dir,
        stage_on_host,
        tensors_of_safetensors,
        write_whole,
    )
except ModuleNotFoundError:  # in a server started by rollouts.sync.launch: their copies beside this one
    from rollouts_broadcast_group import close_group, connect_to_trainer, flat_views, read_plan, receive_flat_buckets  # type: ignore[no-redef,import-not-found]
    from rollouts_fingerprint_torch import fingerprint_torch, with_sync_fault  # type: ignore[no-redef,import-not-found]
    from rollouts_worker_ipc import IpcWeightReceiver  # type: ignore[no-redef,import-not-found]
    from rollouts_worker_receive import (  # type: ignore[no-redef,import-not-found]
        ChecksumsOnArrival,
        ReceiveBuffer,
        fetch_bytes,
        files_signature,
        keep_in_cache,
        keep_newest,
        read_dir,
        stage_on_host,
        tensors_of_safetensors,
        write_whole,
    )


def _checksums(tensors: dict[str, Any]) -> dict[str, int]:
    return fingerprint_torch(tensors)  # one wait for the device per load


class SafetensorsWeightLoader(IpcWeightReceiver):
    """Mixed into vLLM's Worker class; its methods are called through POST /collective_rpc."""

    def _rollouts_host_buffers(self, sizes: list[int]) -> list[Any]:
        """Host views of `sizes` bytes in the buffer this worker keeps between syncs (see ReceiveBuffer)."""
        self._rollouts_held = None  # may be views of the buffer this sync overwrites
        self._rollouts_settle()  # the last sync's copy out of the buffer
        buffer = getattr(self, "_rollouts_receive_buffer", None)
        if buffer is None:
            buffer = self._rollouts_receive_buffer = ReceiveBuffer()
        return buffer.take(sizes)

    def _rollouts_settle(self) -> None:
        """Wait for the last sync's copy into the cache. Should it have failed, the cache no longer
        holds the weights served, and only a full update (which needs none of it) loads until one
        succeeds (`_rollouts_cache_lost` says why)."""
        pending: Future[None] | None = getattr(self, "_rollouts_cache_copy", None)
        if pending is None:
            return
        self._rollouts_cache_copy: Future[None] | None = None
        try:
            pending.result()
        except Exception as exc:  # noqa: BLE001 - kept as the reason later loads give
            self._rollouts_cache_lost = f"copying the weights of the last sync into the worker's cache failed: {exc!r}"

    def _rollouts_keep(self, cache: dict[str, Any], incoming: dict[str, Any], *, owned: bool) -> None:
        """`incoming` into the cache: as they are when `owned` (host tensors of their own, read from
        files), else copied by a thread of its own."""
        if owned:
            cache.update(incoming)
            self._rollouts_cache_lost = ""
            return
        pool = getattr(self, "_rollouts_cache_pool", None)
        if pool is None:
            pool = self._rollouts_cache_pool = ThreadPoolExecutor(1, thread_name_prefix="rollouts-cache")

        def keep() -> None:
            keep_in_cache(cache, incoming)
            self._rollouts_cache_lost = ""

        self._rollouts_cache_copy = pool.submit(keep)

    def _rollouts_base_weights(self) -> dict[str, Any]:
        self._rollouts_settle()
        model_dir = str(self.vllm_config.model_config.model)  # type: ignore[attr-defined]
        signature = (model_dir, files_signature(model_dir))
        cache = getattr(self, "_rollouts_weights", None)
        if cache is None or getattr(self, "_rollouts_signature", None) != signature:
            cache = {}
            for name, _, _ in signature[1]:
                cache.update(load_file(os.path.join(model_dir, name), device="cpu"))
            self._rollouts_weights = cache
            self._rollouts_signature = signature
        return cache

    def rollouts_broadcast_rank(self) -> dict[str, Any]:
        """This worker's rank among the server's workers (one answer per worker: their count sizes the group)."""
        return {"rank": int(self.rank)}  # type: ignore[attr-defined]

    def rollouts_init_broadcast(
        self,
        host: str,
        port: str,
        group: str,
        rank_offset: str,
        world_size: str,
        backend: str,
        setup_timeout_s: str,
        bucket_timeout_s: str,
    ) -> dict[str, Any]:
        """Join the trainer's process group for weight broadcasts as rank `rank_offset` + this worker's rank."""
        rank = int(rank_offset) + int(self.rank)  # type: ignore[attr-defined]
        close_group(getattr(self, "_rollouts_group", None))  # the last connect's (a reconnect after a failure)
        self._rollouts_group = None
        self._rollouts_group_device = self.device if backend == "nccl" else torch.device("cpu")  # type: ignore[attr-defined]
        self._rollouts_group = connect_to_trainer(
            host,
            int(port),
            group=group,
            rank=rank,
            world_size=int(world_size),
            backend=backend,
            setup_timeout_s=float(setup_timeout_s),
            bucket_timeout_s=float(bucket_timeout_s),
        )
        return {"rank": rank}

    def rollouts_receive_broadcast(self, plan_json: str, hold: str = "0") -> dict[str, Any]:
        """Receive every bucket of the plan, then reload with them (all or nothing: a failure before the
        last bucket, or in the load, leaves the weights as they were; hold=<token>: held, see HeldLoads).
        Answers the checksums of the tensors as received, for the trainer's attestation."""
        plan = read_plan(plan_json)
        incoming, checksums, seconds = self._rollouts_receive(plan)
        answer = self._rollouts_apply(incoming, seconds, checksums=checksums, hold=hold)
        return {**answer, "num_bytes": sum(int(b["nbytes"]) for b in plan["buckets"])}

    def rollouts_receive_adapter(self, plan_json: str, config_json: str, token: str) -> dict[str, Any]:
        """Receive a LoRA adapter's tensors (every bucket of the plan) and write them, with
        `config_json`, as a PEFT adapter directory on this worker's host, for vLLM's
        /v1/load_lora_adapter: <tmp>/rollouts-adapters-<token>/v<version> (`token`: 16 hex digits the
        trainer drew, so no one else can know the path before it exists; this user's only), the same
        path on every worker (each file written whole, then renamed into place). Nothing is written
        unless every bucket arrived. The two newest adapters' directories are kept, older ones
        removed. Answers the directory and the checksums of the tensors as received."""
        if len(token) != 16 or any(c not in "0123456789abcdef" for c in token):
            raise ValueError(f"token must be 16 lowercase hex digits, got {token[:40]!r}")
        plan = read_plan(plan_json)
        config = json.loads(config_json)
        if not isinstance(config, dict):
            raise ValueError(f"config_json must be a JSON object (adapter_config.json), got {config_json[:200]!r}")
        incoming, checksums, seconds = self._rollouts_receive(plan)
        start = time.perf_counter()
        root = os.path.join(tempfile.gettempdir(), f"rollouts-adapters-{token}")
        path = os.path.join(root, f"v{int(plan['version'])}")
        os.makedirs(root, mode=0o700, exist_ok=True)  # (makedirs gives the mode to the last directory only)
        os.makedirs(path, mode=0o700, exist_ok=True)
        tensors = {name: tensor.to("cpu").clone() for name, tensor in incoming.items()}  # files own their bytes
        write_whole(os.path.join(path, "adapter_model.safetensors"), save_bytes(tensors, metadata={"format": "pt"}))
        write_whole(os.path.join(path, "adapter_config.json"), json.dumps(config).encode())
        keep_newest(root, 2)
        seconds["write"] = time.perf_counter() - start
        return {"path": path, "num_tensors": len(incoming), "checksums": checksums, "seconds": seconds}

    def _rollouts_receive(self, plan: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int], dict[str, float]]:
        """Every tensor of the plan's buckets, their checksums (each bucket's computed while the next
        one arrives) and the seconds of each step. Drops what a receive before it held."""
        self._rollouts_held = None  # may hold GPU buffers, or views of the host buffer this one reuses
        group = getattr(self, "_rollouts_group", None)
        if group is None:
            raise RuntimeError("no broadcast group: call rollouts_init_broadcast first")
        start = time.perf_counter()
        incoming: dict[str, Any] = {}
        summing = plan.get("checksums", True) is not False  # false: an unattested sync
        device = self._rollouts_group_device
        sizes = [int(b["nbytes"]) for b in plan["buckets"]]
        staged = stage_on_host(device, str(plan.get("stage", "auto")), sum(sizes))
        host: list[Any] = []
        if staged:  # one bucket's room on the GPU, each bucket copied out to the host as it arrives
            staging = torch.empty(max(sizes), dtype=torch.uint8, device=device)
            host, buffers = self._rollouts_host_buffers(sizes), [staging[:n] for n in sizes]
        elif device.type == "cpu":  # on a GPU fresh buffers come from torch's caching allocator already
            buffers = self._rollouts_host_buffers(sizes)
        else:
            buffers = None
        with ThreadPoolExecutor(1, thread_name_prefix="rollouts-checksum") as pool:
            pending, checksums = [], {}
            for k, tensors in enumerate(receive_flat_buckets(group, plan, device, buffers=buffers)):
                tensors = with_sync_fault(tensors)
                if staged:  # summed where it is, then copied out, before the next bucket reuses the room
                    checksums.update(_checksums(tensors) if summing else {})
                    host[k].copy_(buffers[k])  # type: ignore[index]
                    tensors = flat_views(host[k], plan["buckets"][k])
                elif summing:
                    pending.append(pool.submit(_checksums, tensors))
                incoming.update(tensors)
            seconds = {"receive": time.perf_counter() - start}
            checksums |= {name: value for done in pending for name, value in done.result().items()}
        seconds["checksum"] = time.perf_counter() - start - seconds["receive"]  # what was left after the last bucket
        return incoming, checksums, seconds

    def rollouts_fetch_weights(
        self, url: str, num_bytes: str, timeout_s: str, checksums: str = "1", hold: str = "0"
    ) -> dict[str, Any]:
        """Fetch one safetensors payload of `num_bytes` bytes from `url` (raw bytes, within `timeout_s`),
        then reload with its tensors (all or nothing; hold=<token>: held, see HeldLoads). Answers their
        checksums as received (none with checksums="0": an unattested sync)."""
        start = time.perf_counter()
        (into,) = self._rollouts_host_buffers([int(num_bytes)])
        if checksums == "0":
            fetched = fetch_bytes(url, int(num_bytes), float(timeout_s), into=into)
            incoming = with_sync_fault(tensors_of_safetensors(fetched))
            return self._rollouts_apply(incoming, {"receive": time.perf_counter() - start}, checksums={}, hold=hold)
        with ThreadPoolExecutor(1, thread_name_prefix="rollouts-checksum") as pool:
            arriving = ChecksumsOnArrival(into, pool)  # each tensor's, while the rest arrives
            incoming = tensors_of_safetensors(
                fetch_bytes(url, int(num_bytes), float(timeout_s), into=into, on_progress=arriving)
            )
            seconds = {"receive": time.perf_counter() - start}
            sums = arriving.result()
        seconds["checksum"] = time.perf_counter() - start - seconds["receive"]  # what was left after the last byte
        return self._rollouts_apply(incoming, seconds, checksums=sums, hold=hold)

    def rollouts_load_dir(self, weights_path: str, hold: str = "0") -> dict[str, Any]:
        """Reload from the checkpoint files at `weights_path` (as vLLM's reload_weights does from a path),
        reading them once: answers the checksums of what it read, for the trainer's attestation
        (hold=<token>: held, see HeldLoads)."""
        self._rollouts_held = None
        start = time.perf_counter()
        incoming = with_sync_fault(read_dir(weights_path))
        seconds = {"read": time.perf_counter() - start}
        return self._rollouts_apply(incoming, seconds, known_only=False, owned=True, hold=hold)

    def _rollouts_apply(
        self,
        incoming: dict[str, Any],
        seconds: dict[str, float],
        *,
        known_only: bool = True,
        checksums: dict[str, int] | None = None,
        owned: bool = False,
        hold: str = "0",
    ) -> dict[str, Any]:
        """Reload with the base weights updated by `incoming` (checked first: with `known_only` every name
        must be a checkpoint tensor's, and each shape must match); the cache takes them once the reload
        succeeded: as they are when `owned` (host tensors nothing else writes), else copied into its own
        tensors (`incoming` may be views of the receive buffer, which the next sync overwrites). Answers
        the checksums of `incoming` (computed here unless given) and each step's seconds. With
        hold=<token> nothing is loaded: `incoming` waits for rollouts_commit (see HeldLoads)."""
        weights = self._rollouts_base_weights()
        if known_only:
            unknown = sorted(set(incoming) - set(weights))
            if unknown:
                raise ValueError(f"tensors not in the model's checkpoint: {unknown[:10]} ({len(unknown)} in all)")
        self._rollouts_check_whole(weights, incoming)
        for name, tensor in incoming.items():
            if name in weights and tuple(tensor.shape) != tuple(weights[name].shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, the checkpoint has {tuple(weights[name].shape)}"
                )
        if checksums is None:
            start = time.perf_counter()
            checksums = _checksums(incoming)
            seconds["checksum"] = time.perf_counter() - start
        held = self._rollouts_hold(hold, incoming, owned=owned)
        if not held:
            self._rollouts_load(weights, incoming, seconds, owned=owned)
        return {"num_tensors": len(incoming), "checksums": checksums, "seconds": seconds, "held": held}

    def _rollouts_check_whole(self, weights: dict[str, Any], incoming: dict[str, Any]) -> None:
        """After a failed copy into the cache, only a full update (which needs none of it) may load."""
        lost = getattr(self, "_rollouts_cache_lost", "")
        if lost and not set(weights) <= set(incoming):
            raise RuntimeError(f"{lost}; only a full update (every checkpoint tensor) can load until one succeeds")

    def _rollouts_load(
        self, weights: dict[str, Any], incoming: dict[str, Any], seconds: dict[str, float], *, owned: bool
    ) -> None:
        start = time.perf_counter()
        # vLLM's parameters do not require grad, so no autograd graph is built here.
        self.reload_weights(weights_iterator=iter(list({**weights, **incoming}.items())))  # type: ignore[attr-defined]
        seconds["load"] = time.perf_counter() - start
        self._rollouts_keep(weights, incoming, owned=owned)  # after this call answered, unless owned

    def rollouts_load_weights(
        self, data_b64: str, apply: str = "1", first: str = "1", hold: str = "0"
    ) -> dict[str, Any]:
        """Stage the tensors in `data_b64` (base64 safetensors); with apply="1" reload the model with them
        (with hold=<token> too: held, see HeldLoads).

        An update is a run of chunks: the first has first="1" (it drops whatever a failed earlier
        update left staged), the last apply="1". The staged tensors join the cached weights only
        once the reload succeeds, and any error drops them, so a failed update never leaks into a
        later one. Each request is checked whole before anything is staged. Returns
        {"num_tensors": tensors in this request, "applied": bool, "checksums": {name: checksum of
        the tensor as received}}. Unknown tensor names are an error (named), so a typo cannot
        silently leave a weight stale.
        """
        if first == "1" or not hasattr(self, "_rollouts_staged"):
            self._rollouts_staged: dict[str, Any] = {}
            self._rollouts_held = None
        try:
            weights = self._rollouts_base_weights()
            incoming = with_sync_fault(load_bytes(base64.b64decode(data_b64)))
            unknown = sorted(set(incoming) - set(weights))
            if unknown:
                raise ValueError(f"tensors not in the model's checkpoint: {unknown[:10]} ({len(unknown)} in all)")
            for name, tensor in incoming.items():
                if tuple(tensor.shape) != tuple(weights[name].shape):
                    raise ValueError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)}, the checkpoint has {tuple(weights[name].shape)}"
                    )
            self._rollouts_staged.update(incoming)
            applied = apply == "1"
            held = False
            if applied:
                staged, self._rollouts_staged = self._rollouts_staged, {}
                self._rollouts_check_whole(weights, staged)
                held = self._rollouts_hold(hold, staged, owned=True)  # decoded: tensors of their own
                if not held:
                    self._rollouts_load(weights, staged, {}, owned=True)
        except BaseException:
            self._rollouts_staged = {}
            raise
        return {"num_tensors": len(incoming), "applied": applied, "checksums": _checksums(incoming), "held": held}

    def rollouts_fingerprint(self, weights_path: str) -> dict[str, Any]:
        """{"checksums": {name: checksum}} of the checkpoint tensors at `weights_path` as this worker
        reads them (the files a disk reload from there loaded)."""
        return {"checksums": _checksums(with_sync_fault(read_dir(weights_path)))}
