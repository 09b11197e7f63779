"""The fake server's SGLang broadcast endpoints: /get_server_info, /init_weights_update_group and
/update_weights_from_distributed (shapes of sglang/srt/entrypoints/http_server.py and io_struct.py).

The fake joins the trainer's gloo group in a worker thread, and receives one broadcast per tensor
of an update, as SGLang's model runner does; it loads them only once every tensor arrived. torch
(the `broadcast` extra) is reached only when these endpoints are called, through the worker
group helpers (rollouts.sync.broadcast_group), so the rest of the fake server needs no torch.
"""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np

from rollouts.sync.fake_http import HTTPError, json_response

_TIMEOUT_S = 60.0  # the fake's own bound on joining and on each tensor
ROUTES = frozenset(
    {
        ("GET", "/get_server_info"),
        ("POST", "/init_weights_update_group"),
        ("POST", "/destroy_weights_update_group"),
        ("POST", "/update_weights_from_distributed"),
        ("POST", "/begin_weight_update"),
        ("POST", "/end_weight_update"),
    }
)


def _join(body: dict[str, Any]) -> Any:
    from rollouts.sync import broadcast_group as ext  # torch, from the `broadcast` extra

    return ext.join_as_sglang(
        str(body["master_address"]),
        int(body["master_port"]),
        group=str(body["group_name"]),
        rank=int(body["rank_offset"]),
        world_size=int(body["world_size"]),
        backend=str(body.get("backend", "gloo")),
        timeout_s=_TIMEOUT_S,
    )


def _destroy(group: Any) -> None:
    from rollouts.sync import broadcast_group as ext

    ext.destroy_sglang_group(group)


def _receive(group: Any, body: dict[str, Any]) -> dict[str, np.ndarray]:
    from rollouts.sync import broadcast_group as ext

    specs = list(zip(body["names"], body["dtypes"], body["shapes"], strict=True))
    out = ext.receive_tensor_list(group, specs, "cpu")
    # numpy has no bfloat16: 16-bit floats are kept as float32 (exact)
    return {n: (t.float() if t.is_floating_point() and t.element_size() == 2 else t).numpy() for n, t in out.items()}


async def dispatch(state: Any, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """Answer one of ROUTES for the fake server's `state` (a FakeEngineState)."""
    if path == "/get_server_info":
        return json_response(200, {"tp_size": 1, "dp_size": 1, "weight_version": state.weight_version})
    if path == "/init_weights_update_group":
        try:
            state.broadcast_group = await anyio.to_thread.run_sync(_join, body)
        except (RuntimeError, KeyError, ValueError) as exc:
            return json_response(200, {"success": False, "message": f"init group failed: {exc}"})
        return json_response(200, {"success": True, "message": "Succeeded to initialize custom process group."})
    if path in ("/begin_weight_update", "/end_weight_update"):  # SGLang 0.5.23's sessions, when state.sessions
        if not state.sessions:
            raise HTTPError(404, "Not Found")
        if (path == "/begin_weight_update") == state.in_session:
            raise HTTPError(400, f"{path}: a session is {'open' if state.in_session else 'not open'}")
        state.in_session = path == "/begin_weight_update"
        return json_response(200, {"success": True, "message": ""})
    if path == "/destroy_weights_update_group":
        group, state.broadcast_group = state.broadcast_group, None
        if group is None:
            return json_response(400, {"success": False, "message": f"no group {body.get('group_name')!r}"})
        await anyio.to_thread.run_sync(_destroy, group)
        return json_response(200, {"success": True, "message": "Succeeded to destroy custom process group."})
    if state.broadcast_group is None:
        raise HTTPError(400, "no weights update group: call /init_weights_update_group first")
    if state.sessions and not state.in_session:
        raise HTTPError(400, "update_weights_from_distributed outside a weight-update session (/begin_weight_update)")
    try:
        incoming = await anyio.to_thread.run_sync(_receive, state.broadcast_group, body)
    except (RuntimeError, KeyError, ValueError) as exc:
        state.broadcast_group = None  # a broken group is never used again
        return json_response(200, {"success": False, "message": f"Failed to update weights: {exc}"})
    unknown = sorted(set(incoming) - set(state.weights)) if state.weights else []
    if unknown:
        return json_response(200, {"success": False, "message": f"tensors not in the model: {unknown}"})
    state.weights = {**state.weights, **incoming}
    if body.get("weight_version") is not None:
        state.weight_version = str(body["weight_version"])
    if body.get("flush_cache", True):
        state.num_cache_resets += 1
    return json_response(200, {"success": True, "message": "Succeeded to update parameter online."})
