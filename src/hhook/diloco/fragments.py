r"""The model's parameters as the fragments an outer synchronization exchanges, and this
rank's shard of each.

Streaming DiLoCo (arXiv 2501.18512) syncs ``P`` fragments at staggered times; its
fragments are strided over depth, so each holds shallow and deep layers alike: layer ``i``
goes to fragment ``i mod P``. :func:`partition` finds the layers from the parameters'
names (a name's prefix up to its first number, ``blocks.3``, is a repeated layer; any
other parameter belongs to its module, ``head``). Peak bandwidth follows the largest
fragment, so where striding leaves one much above ``1 / P`` (a large embedding) the
strided order is cut into equal ranges instead, splitting the parameters at the cuts.

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


#: Strided fragments are kept while their largest is at most this much above 1/P.
STRIDED_SLACK = 1.1


def partition(named: list[tuple[str, torch.Tensor]], fragments) -> list[list[tuple]]:
    """``fragments`` (an int ``P``; or lists of parameter names, each parameter in exactly
    one) -> each fragment's pieces ``(name, parameter, start, stop)`` (a flat range of the
    parameter), in model order. ``P``: layer ``i`` in fragment ``i mod P`` where the
    largest fragment stays within :data:`STRIDED_SLACK` of ``1 / P`` of the elements, else
    the layers in that strided order cut into ``P`` equal ranges (:func:`balanced`).
    ValueError for a partition that does not cover ``named`` once."""
    if isinstance(fragments, int) and not isinstance(fragments, bool):
        layers = list(dict.fromkeys(layer_of(n) for n, _ in named))
        if not 1 <= fragments <= len(layers):
            raise ValueError(f"hhook.diloco: fragments={fragments} needs 1..{len(layers)} (the model's layers: "
                             f"{', '.join(layers[:8])}{', ...' if len(layers) > 8 else ''})")
        index = {layer: i % fragments for i, layer in enumerate(layers)}
        out = [[] for _ in range(fragments)]
        for name, p in named:
            out[index[layer_of(name)]].append((name, p, 0, p.numel()))
        total, largest = sum(p.numel() for _, p in named), max(sum(q[3] for q in f) for f in out)
        return out if largest * fragments <= STRIDED_SLACK * total else balanced(out)
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
        out[where[name]].append((name, p, 0, p.numel()))
    return out


def balanced(strided: list[list[tuple]]) -> list[list[tuple]]:
    """The pieces of ``strided`` in that order (fragment 0's layers, then fragment 1's...),
    cut into ``P`` ranges of equal size: a parameter across a cut is split there (an
    embedding larger than ``1 / P`` spans fragments), so each fragment still holds layers
    of several depths. FSDP2's sharded parameters and non-contiguous ones are not split:
    each goes whole to the fragment of its middle."""
    order = [piece for fragment in strided for piece in fragment]
    count = len(strided)
    total = sum(q[3] for q in order)
    cuts = [total * (i + 1) // count for i in range(count)]  # fragment i ends at cuts[i]
    out = [[] for _ in range(count)]
    at = 0
    for name, p, _, n in order:
        if _local(p) is not None or not p.is_contiguous():
            out[next(i for i, c in enumerate(cuts) if at + n // 2 < c or i == count - 1)].append((name, p, 0, n))
        else:
            lo = 0
            while lo < n:
                i = next(i for i, c in enumerate(cuts) if at + lo < c or i == count - 1)
                hi = n if i == count - 1 else min(n, cuts[i] - at)
                out[i].append((name, p, lo, hi))
                lo = hi
        at += n
    position = {id(p): k for k, (_, p, _, _) in enumerate(order)}
    return [sorted(f, key=lambda q: (position[id(q[1])], q[2])) for f in out if f] if all(out) else strided


def _local(p: torch.Tensor) -> torch.Tensor | None:
    """An FSDP2 parameter's local shard (a view of its storage), or None for a plain tensor."""
    if type(p).__name__ == "DTensor" or hasattr(p, "placements"):
        return p.to_local()
    return None


class Fragment:
    """One fragment's pieces and this rank's shard of them (see the module)."""

    def __init__(self, index: int, pieces: list[tuple], ranks_per_site: int, local_rank: int):
        self.index = index
        self.names = [n if (lo, hi) == (0, p.numel()) else f"{n}[{lo}:{hi}]" for n, p, lo, hi in pieces]
        self.shapes = [tuple(p.shape) for _, p, _, _ in pieces]  # global shapes (a DTensor's too)
        with torch.no_grad():
            locals_ = [_local(p) for _, p, _, _ in pieces]
        self.replicated = [(p, lo, hi) for (_, p, lo, hi), loc in zip(pieces, locals_) if loc is None]
        self.owned = [loc for loc in locals_ if loc is not None]
        self.numel = sum(hi - lo for _, lo, hi in self.replicated)
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
                flat = torch.cat([p.detach().reshape(-1)[lo:hi] for p, lo, hi in self.replicated])
                flat = flat[self.start : self.stop]
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
                for p, lo, hi in self.replicated:
                    target = p.detach() if (lo, hi) == (0, p.numel()) else p.detach().view(-1)[lo:hi]
                    target.copy_(full[offset : offset + hi - lo].view_as(target))
                    offset += hi - lo
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
