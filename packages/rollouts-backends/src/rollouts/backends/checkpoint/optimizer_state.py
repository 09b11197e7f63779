"""Optimizer state in safetensors: the full state as flat tensors "<parameter name>::<key>" (one
process), or under FSDP2 each rank's own shards with their place in the full tensors recorded in the
file's metadata. Loading on the same layout reads only the rank's own file; on another world size
(or without FSDP) the shards are joined and re-split.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import safetensors
import safetensors.torch
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard

from rollouts.backends.checkpoint.dirs import verify_files
from rollouts.backends.train.components import TrainingComponents
from rollouts.backends.train.distributed import all_ok, is_distributed, rank_world

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import OptimizerStateType

__all__ = [
    "full_optimizer_state",
    "join_shards",
    "load_optimizer_state",
    "optimizer_shard_name",
    "sharded_optimizer_state",
]


_KEY_SEP = "::"


def full_optimizer_state(components: TrainingComponents) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Full optimizer state as flat tensors '<param name>::<key>' and JSON param groups."""

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(components.model, components.optimizer, options=options)
    tensors = {flat: torch.as_tensor(value).detach().to("cpu").contiguous() for flat, value in _flat_entries(state)}
    return tensors, _json_param_groups(state)


def _flat_entries(state: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(flat key '<param name>::<key>', value) for each entry of an optimizer state dict's per-parameter state."""
    for name, entries in state.get("state", {}).items():
        for key, value in entries.items():
            yield f"{name}{_KEY_SEP}{key}", value


def _json_param_groups(state: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in state.get("param_groups", [])]


def _shard_info(tensor: Any) -> dict[str, Any] | None:
    """Where a DTensor's local shard sits in the full tensor ({shape, dim, index, count}); None for a
    plain (replicated) tensor such as AdamW's step count."""

    if not isinstance(tensor, DTensor):
        return None
    mesh, placements = tensor.device_mesh, tensor.placements
    sharded = [(mesh_dim, p) for mesh_dim, p in enumerate(placements) if not isinstance(p, Replicate)]
    if len(sharded) > 1 or any(type(p) is not Shard for _, p in sharded):  # (not _StridedShard: FSDP + TP)
        raise ValueError(
            f"cannot save optimizer state with placements {placements}: one Shard(dim) mesh dimension at most"
        )
    if not sharded:
        return {"shape": list(tensor.shape), "dim": 0, "index": 0, "count": 1}
    mesh_dim, placement = sharded[0]
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not part of the optimizer state's device mesh")
    return {
        "shape": list(tensor.shape),
        "dim": cast(Shard, placement).dim,  # exactly Shard, checked above
        "index": coordinate[mesh_dim],
        "count": mesh.size(mesh_dim),
    }


def sharded_optimizer_state(
    components: TrainingComponents,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[dict[str, Any]]]:
    """This rank's optimizer shards as flat tensors, their layout {flat key: shard_of info}, and the param groups."""

    state = get_optimizer_state_dict(components.model, components.optimizer)
    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, Any] = {}
    for flat, value in _flat_entries(state):
        info = _shard_info(value)
        if info is not None:
            layout[flat] = info
            value = value.to_local()
        tensors[flat] = torch.as_tensor(value).detach().to("cpu").contiguous()
    return tensors, layout, _json_param_groups(state)


def optimizer_shard_name(rank: int, world: int) -> str:
    return f"optimizer-rank{rank:05d}-of-{world:05d}.safetensors"


def _read_shard_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors of one optimizer shard file and the layout recorded in its metadata."""
    with safetensors.safe_open(str(path), framework="pt") as f:
        layout = json.loads((f.metadata() or {}).get("layout", "{}"))
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    return tensors, layout


def join_shards(shard_files: list[Path]) -> dict[str, torch.Tensor]:
    """Full optimizer tensors from per-rank shard files (one copy per shard index, joined along the shard dim)."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    infos: dict[str, dict[str, Any]] = {}
    full: dict[str, torch.Tensor] = {}
    for path in shard_files:
        tensors, layout = _read_shard_file(path)
        for key, tensor in tensors.items():
            info = layout.get(key)
            if info is None:
                full.setdefault(key, tensor)  # replicated: every rank holds the same value
                continue
            infos[key] = info
            pieces.setdefault(key, {})[info["index"]] = tensor
    for key, info in infos.items():
        found = pieces[key]
        if sorted(found) != list(range(info["count"])):
            raise ValueError(f"optimizer state {key!r}: shards {sorted(found)} found, {info['count']} expected")
        joined = torch.cat([found[i] for i in range(info["count"])], dim=info["dim"])
        if list(joined.shape) != info["shape"]:
            raise ValueError(f"optimizer state {key!r}: shards join to {list(joined.shape)}, recorded {info['shape']}")
        full[key] = joined
    return full


def _optimizer_state_dict(flat: Mapping[str, Any], groups: list[dict[str, Any]]) -> OptimizerStateType:
    """torch's optimizer state dict from flat tensors '<param name>::<key>' and the param groups."""
    state: dict[str, Any] = {}
    for key, tensor in flat.items():
        name, entry = key.rsplit(_KEY_SEP, 1)
        state.setdefault(name, {})[entry] = tensor
    return {"state": state, "param_groups": groups}


def _local_layout_matches(components: TrainingComponents, layout: Mapping[str, Any]) -> bool:
    """Whether this rank's own optimizer shards would have exactly the recorded layout."""
    params = dict(components.model.named_parameters())
    for key, info in layout.items():
        param = params.get(key.rsplit(_KEY_SEP, 1)[0])
        if param is None or not hasattr(param, "device_mesh"):
            return False
        if _shard_info(param) != info:
            return False
    return True


_IMPLEMENTATION_KEYS = ("fused", "foreach")


def load_optimizer_state(components: TrainingComponents, path: Path, record: Mapping[str, Any]) -> None:
    files = record["files"]
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else dict(g) for g in record["optimizer_param_groups"]]
    # Which implementation steps the optimizer (fused, foreach) is this run's choice for its weights
    # and device, not the saver's: torch takes every group setting from the loaded groups, so a
    # checkpoint from another device or an older version would pin its own.
    for group, mine in zip(groups, components.optimizer.param_groups, strict=False):
        group.update({key: mine[key] for key in _IMPLEMENTATION_KEYS if key in mine})
    shard_files = sorted(n for n in files if n.startswith("optimizer-rank"))
    if "optimizer.safetensors" in files:
        verify_files(components, path, files, ["optimizer.safetensors"])
        flat = safetensors.torch.load_file(str(path / "optimizer.safetensors"))
    elif shard_files:
        own = optimizer_shard_name(rank_world()[0], len(shard_files))
        if is_distributed(components.model) and torch.distributed.get_world_size() == len(shard_files):
            verify_files(components, path, files, [own])  # each rank reads (and checks) only its own shard
            tensors, layout = _read_shard_file(path / own)
            # Same decision on every rank (set_optimizer_state_dict is collective): agree on it.
            if all_ok(_local_layout_matches(components, layout)):
                params = dict(components.model.named_parameters())
                local: dict[str, Any] = {}
                for key, tensor in tensors.items():
                    if key in layout:
                        # sharded: _local_layout_matches found its device mesh
                        param = cast(DTensor, params[key.rsplit(_KEY_SEP, 1)[0]])
                        tensor = DTensor.from_local(
                            tensor.to(param.to_local().device),
                            param.device_mesh,
                            param.placements,
                            run_check=False,
                            shape=param.shape,
                            stride=param.stride(),
                        )
                    local[key] = tensor
                set_optimizer_state_dict(
                    components.model,
                    components.optimizer,
                    _optimizer_state_dict(local, groups),
                )
                return
        verify_files(components, path, files, shard_files)
        flat = join_shards([path / n for n in shard_files])
    else:
        raise ValueError(f"checkpoint {str(path)!r} holds no optimizer state (saved with save_optimizer=False)")
    set_optimizer_state_dict(
        components.model,
        components.optimizer,
        _optimizer_state_dict(flat, groups),
        options=StateDictOptions(full_state_dict=True),
    )
