r"""The model's parameters as the fragments an outer synchronization exchanges, and this
rank's shard of each.

Streaming DiLoCo (arXiv 2501.18512) syncs ``P`` fragments at staggered times; its
fragments are strided over depth, so each holds shallow and deep layers alike: layer ``i``
goes to fragment ``i mod P``. :func:`partition` finds the layers from the parameters'
names (a name's prefix up to its first number, ``blocks.3``, is a repeated layer; any
other parameter belongs to its module, ``head``).

A :class:`Fragment` reads and writes this rank's shard as one float32 vector: ``1 / k``
of the parameters every rank of the site holds alike (DDP: ``k`` ranks per site, shard
``local_rank``, padded with zeros to ``k`` equal pieces), followed by the local shards of
FSDP2's ``DTensor`` parameters, which the rank owns already. Writing all-gathers the
replicated pieces inside the site.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from .sites import all_gather_flat, explained


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: its name up to the first number (a repeated
    block), else its module (the name without its last part), else the name."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def partition(named: list[tuple[str, torch.Tensor]], fragments) -> list[list[tuple[str, torch.Tensor]]]:
    """``fragments`` (an int ``P``: layer ``i`` in fragment ``i mod P``; or lists of
    parameter names, each parameter in exactly one) -> the parameters of each fragment,
    in model order. ValueError for a partition that does not cover ``named`` once."""
    if isinstance(fragments, int) and not isinstance(fragments, bool):
        layers = list(dict.fromkeys(layer_of(n) for n, _ in named))
        if not 1 <= fragments <= len(layers):
            raise ValueError(f"hhook.diloco: fragments={fragments} needs 1..{len(layers)} (the model's layers: "
                             f"{', '.join(layers[:8])}{', ...' if len(layers) > 8 else ''})")
        index = {layer: i % fragments for i, layer in enumerate(layers)}
        out = [[] for _ in range(fragments)]
        for name, p in named:
            out[index[layer_of(name)]].append((name, p))
        return out
    groups = [list(g) for g in fragments]
    where = {}
    for i, group in enumerate(groups):
        for name in group:
            if name in where:
                raise ValueError(f"hhook.diloco: parameter {name!r} is in fragments {where[name]} and {i}")
            where[name] = i
    names = [n for n, _ in named]
    if set(where) != set(names) or not all(groups):
        missing, extra = sorted(set(names) - set(where)), sorted(set(where) - set(names))
        raise ValueError(f"hhook.diloco: the fragments must name every synchronized parameter once, and none may "
                         f"be empty (missing {missing[:5]}, unknown {extra[:5]})")
    out = [[] for _ in groups]
    for name, p in named:
        out[where[name]].append((name, p))
    return out


def _local(p: torch.Tensor) -> torch.Tensor | None:
    """An FSDP2 parameter's local shard (a view of its storage), or None for a plain tensor."""
    if type(p).__name__ == "DTensor" or hasattr(p, "placements"):
        return p.to_local()
    return None


class Fragment:
    """One fragment's parameters and this rank's shard of them (see the module)."""

    def __init__(self, index: int, named: list[tuple[str, torch.Tensor]], ranks_per_site: int, local_rank: int):
        self.index = index
        self.names = [n for n, _ in named]
        self.shapes = [tuple(p.shape) for _, p in named]  # global shapes (a DTensor's too)
        with torch.no_grad():
            locals_ = [_local(p) for _, p in named]
        self.replicated = [p for (_, p), loc in zip(named, locals_) if loc is None]
        self.owned = [loc for loc in locals_ if loc is not None]
        self.numel = sum(p.numel() for p in self.replicated)
        self.piece = -(-self.numel // ranks_per_site)  # each local rank's share, padded
        self.start = min(local_rank * self.piece, self.numel)
        self.stop = min(self.start + self.piece, self.numel)
        self.ranks_per_site = ranks_per_site
        self.length = self.piece + sum(t.numel() for t in self.owned)  # this rank's shard

    def read(self) -> torch.Tensor:
        """This rank's shard of the current parameters, float32, a new tensor."""
        with torch.no_grad():
            parts = []
            if self.replicated:
                flat = torch.cat([p.detach().reshape(-1) for p in self.replicated])[self.start : self.stop]
                parts.append(flat.float())
                if self.stop - self.start < self.piece:
                    parts.append(torch.zeros(self.piece - (self.stop - self.start), device=flat.device))
            parts += [t.detach().reshape(-1).float() for t in self.owned]
            return torch.cat(parts) if parts else torch.zeros(0)

    def write(self, shard: torch.Tensor, site_group) -> None:
        """Set the parameters from every rank's ``shard`` of the site: the replicated
        pieces all-gathered over ``site_group`` (blocking), the owned ones copied."""
        with torch.no_grad():
            if self.replicated:
                full = shard[: self.piece]
                if self.ranks_per_site > 1:
                    full = torch.empty(self.piece * self.ranks_per_site, dtype=shard.dtype, device=shard.device)
                    with explained(f"hhook.diloco's all-gather of fragment {self.index} inside the site", site_group):
                        all_gather_flat(full, shard[: self.piece].contiguous(), site_group)
                offset = 0
                for p in self.replicated:
                    p.detach().copy_(full[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
            offset = self.piece
            for t in self.owned:
                t.detach().copy_(shard[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def digest(self, shapes: bool = True) -> int:
        """62 bits of the names and global shapes (``shapes``), or of this rank's shard
        lengths: what every site (every rank of one ring) must hold alike."""
        text = repr(list(zip(self.names, self.shapes))) if shapes else repr((self.piece, [t.numel() for t in self.owned]))
        return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "little") >> 2


def first_difference(fragments: list[Fragment]) -> str:
    """The first parameter (fragment, name, shape) where the ranks differ, found with one
    all-gather of every rank's list (after the options check found that they do: every
    rank calls it alike). E.g. a model compiled on one site only (``_orig_mod.`` names)."""
    mine = [(f.index, name, shape) for f in fragments for name, shape in zip(f.names, f.shapes)]
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    for i in range(max(len(r) for r in rows)):
        seen = {}
        for rank, row in enumerate(rows):
            seen.setdefault(row[i] if i < len(row) else None, rank)
        if len(seen) > 1:
            said = "; ".join(f"rank {r} has none" if v is None else f"rank {r} has {v[1]} {list(v[2])} in "
                             f"fragment {v[0]}" for v, r in seen.items())
            return f"The first differing parameter (#{i}): {said}."
    return ""
