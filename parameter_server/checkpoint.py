"""The shards' part of a DCP checkpoint: parameters, optimizer state and clocks, keyed by *parameter name*.

A shard holds flat chunks of tensors placed by the ring, so its own state only
means something for one shard count and one ``chunk_elems``. A checkpoint
instead holds whole tensors (the chunks joined back in order; every
server-side optimizer is elementwise, so its state joins the same way), and a
resumed job splits them again for *its* ring: any shard count, any chunk size,
any number of data ranks. DCP writes and reads them (one process, the
controller: ``no_dist``), into the checkpoint's ``ps/`` folder, so the
checksum manifest, retention and corrupt-checkpoint handling cover them with
the ranks' files.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from parameter_server import optimizers
from parameter_server.ring import HashRing, chunk_count, chunk_key, split

FOLDER = "ps"
PARAM, OPT, CLOCK = "ps.param/", "ps.opt/", "ps.clock/"  # "/": parameter names hold dots


def _join(name: str, numel: int, chunk_elems: int, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([parts[chunk_key(name, i)].reshape(-1) for i in range(chunk_count(numel, chunk_elems))])


def whole(states: list[dict], chunk_elems: int, clocks: dict) -> dict[str, torch.Tensor]:
    """One flat state dict from the shards' ``state()`` answers (each chunk from whichever holder has it: both
    hold the same values) and the ``clocks`` ({name: int or list of ints})."""
    layout, params, opts = {}, {}, {}
    for state in states:
        layout.update(state["layout"])
        params.update(state["params"])
        opts.update(state["opts"])
    out = {}
    for name, info in layout.items():
        numel = math.prod(info["shape"])
        out[PARAM + name] = _join(name, numel, chunk_elems, params).reshape(info["shape"])
        first = opts[chunk_key(name, 0)]["state"].get(0, {})
        for field, value in first.items():
            if not torch.is_tensor(value):
                continue  # a buffer the optimizer has not made yet
            if value.dim() == 0:  # a count (Adam's step): one per chunk, the same on every chunk
                out[f"{OPT}{name}/{field}"] = value.clone()
            else:  # elementwise, shaped like the chunk
                parts = {chunk_key(name, i): opts[chunk_key(name, i)]["state"][0][field]
                         for i in range(chunk_count(numel, chunk_elems))}
                out[f"{OPT}{name}/{field}"] = _join(name, numel, chunk_elems, parts)
    for name, value in clocks.items():
        out[CLOCK + name] = torch.tensor(value, dtype=torch.int64)
    return out


def save(flat: dict[str, torch.Tensor], ckpt: str | Path) -> Path:
    """Write ``flat`` as a DCP checkpoint in ``ckpt``'s ``ps/`` folder."""
    path = Path(ckpt) / FOLDER
    with _one_process():
        dcp.save(flat, checkpoint_id=str(path), no_dist=True)
    return path


def _dcp_metadata(path: Path):
    return dcp.FileSystemReader(str(path)).read_metadata()


def _dcp_load(flat: dict, path: Path, **kwargs) -> None:
    dcp.load(flat, checkpoint_id=str(path), **kwargs)


def load(ckpt: str | Path, read_metadata=_dcp_metadata, read=_dcp_load) -> dict[str, torch.Tensor] | None:
    """What ``save`` wrote (None when ``ckpt`` has no ``ps/`` folder: an all-reduce run's checkpoint).

    ``read_metadata(path)`` and ``read(flat, path, no_dist=True)`` are DCP's own by default; the controller passes
    ones that unpickle no code from the files (``workers.state.dcp_reading``, which this package cannot import)."""
    path = Path(ckpt) / FOLDER
    if not (path / ".metadata").is_file():
        return None
    meta = read_metadata(path).state_dict_metadata
    flat = {key: torch.empty(m.size, dtype=m.properties.dtype) for key, m in meta.items()}
    with _one_process():
        read(flat, path, no_dist=True)
    return flat


@contextmanager
def _one_process():
    """DCP warns that no process group is set up: here that is the point (the controller writes alone)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def clocks(flat: dict[str, torch.Tensor]) -> dict[str, list[int] | int]:
    return {k.removeprefix(CLOCK): v.tolist() for k, v in flat.items() if k.startswith(CLOCK)}


def shard_states(flat: dict[str, torch.Tensor], ring: HashRing, chunk_elems: int, optim: dict) -> list[dict]:
    """Per shard of ``ring``, the ``PSShard.load`` state of the chunks it holds (primary or successor)."""
    states = [{"params": {}, "opts": {}, "layout": {}} for _ in range(ring.shards)]
    for key, value in flat.items():
        if not key.startswith(PARAM):
            continue
        name = key.removeprefix(PARAM)
        fields = {k.removeprefix(f"{OPT}{name}/"): v for k, v in flat.items() if k.startswith(f"{OPT}{name}/")}
        split_fields = {f: split(name, v, chunk_elems) if v.dim() else None for f, v in fields.items()}
        for ck, chunk in split(name, value, chunk_elems).items():
            state = {f: (parts[ck] if parts is not None else fields[f].clone()) for f, parts in split_fields.items()}
            for s in ring.holders(ck):
                states[s]["params"][ck] = chunk.clone()
                states[s]["opts"][ck] = _opt_state_dict(chunk, optim, state, value.dim())
                states[s]["layout"][name] = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix(
                    "torch.")}
    return states


def _opt_state_dict(chunk: torch.Tensor, optim: dict, state: dict, ndim: int) -> dict:
    """``torch.optim`` state dict of one chunk (of a tensor of ``ndim`` dimensions) holding ``state``: its groups as
    the job builds them, so a resume takes the job's weight decay for it, not the saving run's."""
    groups = optimizers.build(chunk.clone(), optim, ndim).state_dict()["param_groups"]
    own = {field: value.clone() for field, value in state.items()}  # each holder steps its own moments in place
    return {"state": {0: own} if own else {}, "param_groups": groups}
