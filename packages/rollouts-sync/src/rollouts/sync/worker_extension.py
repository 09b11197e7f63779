"""vLLM worker extension: load weights sent as safetensors bytes in a /collective_rpc body.

Start the server with `--worker-extension-cls rollouts.sync.worker_extension.SafetensorsWeightLoader`
(this module runs inside vLLM's worker process; it touches tensors only through safetensors' torch
loader, vLLM's own methods and rollouts.sync.fingerprint_torch, and nothing in rollouts.sync imports
it, so rollouts.sync itself never imports torch).

Partial updates: a request may name only some checkpoint tensors. vLLM reloads a layer as a whole
(on CPU it repacks linear weights and drops the originals, and a fused qkv_proj is built from
q/k/v together), so the extension keeps the full checkpoint-format weights in host memory:
loaded once from the model directory the server last loaded, updated by each request, and fed
whole to vLLM's in-place `reload_weights`. Cost: one extra copy of the weights in host memory.

Attestation: each load answers the checksums (rollouts.sync.fingerprint) of the tensors this worker
received, and `rollouts_fingerprint` those of the checkpoint files a disk reload read, computed here
in the worker. ROLLOUTS_SYNC_FAULT (see rollouts.sync.fingerprint) flips a bit of the named tensor
after receipt, for tests of the check.
"""

from __future__ import annotations

import base64
import os
from typing import Any

from safetensors.torch import load as load_bytes
from safetensors.torch import load_file

try:
    from rollouts.sync.fingerprint_torch import checksum_torch, flip_bit_torch, sync_fault_target
except ModuleNotFoundError:  # in a server started by rollouts.sync.launch: its copy beside this one's
    from rollouts_fingerprint_torch import checksum_torch, flip_bit_torch, sync_fault_target  # type: ignore[no-redef,import-not-found]

_SAFETENSORS_SUFFIX = ".safetensors"


def _files_signature(model_dir: str) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime_ns) of each safetensors file: changes when the directory is rewritten."""
    out = []
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(_SAFETENSORS_SUFFIX):
            st = os.stat(os.path.join(model_dir, name))
            out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _received(tensors: dict[str, Any]) -> dict[str, Any]:
    """`tensors` as received, with the fault ROLLOUTS_SYNC_FAULT asks for injected (a test hook)."""
    target = sync_fault_target()
    if target is not None and target in tensors:
        flip_bit_torch(tensors[target])
    return tensors


def _checksums(tensors: dict[str, Any]) -> dict[str, int]:
    return {name: checksum_torch(tensor) for name, tensor in tensors.items()}


def _read_dir(path: str) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(_SAFETENSORS_SUFFIX):
            tensors.update(load_file(os.path.join(path, name), device="cpu"))
    return tensors


class SafetensorsWeightLoader:
    """Mixed into vLLM's Worker class; its methods are called through POST /collective_rpc."""

    def _rollouts_base_weights(self) -> dict[str, Any]:
        model_dir = str(self.vllm_config.model_config.model)  # type: ignore[attr-defined]
        signature = (model_dir, _files_signature(model_dir))
        cache = getattr(self, "_rollouts_weights", None)
        if cache is None or getattr(self, "_rollouts_signature", None) != signature:
            cache = {}
            for name, _, _ in signature[1]:
                cache.update(load_file(os.path.join(model_dir, name), device="cpu"))
            self._rollouts_weights = cache
            self._rollouts_signature = signature
        return cache

    def rollouts_load_weights(self, data_b64: str, apply: str = "1", first: str = "1") -> dict[str, Any]:
        """Stage the tensors in `data_b64` (base64 safetensors); with apply="1" reload the model with them.

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
        try:
            weights = self._rollouts_base_weights()
            incoming = _received(load_bytes(base64.b64decode(data_b64)))
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
            if applied:
                staged, self._rollouts_staged = self._rollouts_staged, {}
                # vLLM's parameters do not require grad, so no autograd graph is built here.
                self.reload_weights(weights_iterator=iter(list({**weights, **staged}.items())))  # type: ignore[attr-defined]
                weights.update(staged)
        except BaseException:
            self._rollouts_staged = {}
            raise
        return {"num_tensors": len(incoming), "applied": applied, "checksums": _checksums(incoming)}

    def rollouts_fingerprint(self, weights_path: str) -> dict[str, Any]:
        """{"checksums": {name: checksum}} of the checkpoint tensors at `weights_path` as this worker
        reads them (the files a disk reload from there loaded)."""
        return {"checksums": _checksums(_received(_read_dir(weights_path)))}
