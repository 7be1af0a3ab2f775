"""Pooling a per-token statistic over the ranks of a ``torch.distributed`` process group.

S2T's entropy quantile and 20-Entropy's top-k rank are statistics of the pooled batch, each rank
holding a variable number of relevant tokens. The pooling costs one ``all_gather`` of a count vector
(:func:`exchange_counts`, the only host sync) and one of fixed-width buffers (:func:`gather_padded`),
whose flattened result lists every rank's values in the order (rank, flat index): the order a single
process would see with the ranks' batches concatenated. No function here moves a token tensor to
the host or uses boolean indexing, except those that exchange small python objects.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist


def world_size(group) -> int:
    """1 for ``group=None`` (a single process)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """0 for ``group=None`` (a single process)."""
    return 0 if group is None else dist.get_rank(group)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``(world, j)``: row ``r`` is rank ``r``'s ``counts`` (``(j,)``, any numeric dtype), on the
    device: the caller decides when to read it on the host."""
    counts = counts.reshape(-1).contiguous()
    rows = [torch.empty_like(counts) for _ in range(world_size(group))]
    dist.all_gather(rows, counts, group=group)
    return torch.stack(rows)


def pack_valid(values: torch.Tensor, valid: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """``(width,)``, ``values``' dtype: the entries where ``valid`` (bool, ``values``' shape) holds,
    in row-major order, then ``fill``. Valid entries past ``width`` are truncated. Sync-free: a
    stable argsort of the validity flags replaces boolean indexing."""
    flat = torch.where(valid, values, torch.full_like(values, fill)).reshape(-1)
    invalid_first_key = (~valid).reshape(-1).to(torch.uint8)  # 0 for valid entries, sorted first
    order = torch.argsort(invalid_first_key, stable=True)[:width]
    packed = flat[order]
    if packed.numel() < width:
        packed = torch.cat([packed, packed.new_full((width - packed.numel(),), fill)])
    return packed


def gather_padded(values: torch.Tensor, valid: torch.Tensor, width: int, group, *, fill: float) -> torch.Tensor:
    """``(world, width)``: row ``r`` is :func:`pack_valid` of rank ``r``. ``width``: the largest
    valid count over the ranks (the same python int on every rank, from :func:`exchange_counts`);
    ``fill``: ``+inf`` when the caller sorts ascending, ``-inf`` descending."""
    local = pack_valid(values, valid, width, fill)
    rows = [torch.empty_like(local) for _ in range(world_size(group))]
    dist.all_gather(rows, local, group=group)
    return torch.stack(rows)


def split_contiguous(ranks: list[int], size: int) -> list[list[int]]:
    """``ranks`` cut into consecutive runs of ``size`` (``ValueError`` unless ``size`` divides their count)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or len(ranks) % size:
        raise ValueError(f"split_contiguous: size={size!r} does not divide the {len(ranks)} ranks {ranks}")
    return [list(ranks[start:start + size]) for start in range(0, len(ranks), size)]


def contiguous_subgroups(group, size: int):
    """This rank's part of ``group`` when every such group is cut into groups of ``size`` contiguous
    ranks: the process group of ranks ``[j * size, (j + 1) * size)`` of ``group`` (in ``group``'s rank
    order) that holds this rank. ``group`` itself when ``size`` is its size; None (this process alone,
    as for a single process) when ``size`` is 1 or ``group`` is None.

    Collective over the default group: every rank of the world calls it at the same point with the same
    ``size``, each with its own ``group`` (with sequence parallelism a world holds several data-parallel
    groups). The ranks exchange their groups' members (one ``all_gather_object``), then every rank creates
    every subgroup of every group, in one order (``torch.distributed.new_group`` must be called by every
    rank, in the same order, for every group, members or not). Call it once and keep the result.

    Raises:
        ValueError: ``size`` does not divide ``group``'s size (on every rank alike).
    """
    if group is None:
        return None
    members = dist.get_process_group_ranks(group)
    split_contiguous(members, size)  # the check, before any collective
    if size == len(members):
        return group
    if size == 1:
        return None
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, members)
    mine, me = None, dist.get_rank()
    for ranks in sorted({tuple(r) for r in every}):
        for part in split_contiguous(list(ranks), size):
            created = dist.new_group(part)
            if me in part:
                mine = created
    return mine


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """A summed copy (``t`` itself when ``group`` is None)."""
    if group is not None:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_max(t: torch.Tensor, group) -> torch.Tensor:
    """An element-wise maximum over the ranks, copied (``t`` itself when ``group`` is None)."""
    if group is not None:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def gather_objects(obj, group) -> list:
    if group is None:
        return [obj]
    out = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def exchange_objects(outgoing: list, group, device=None) -> list:
    """All-to-all of picklable objects: ``outgoing[r]`` goes to rank ``r``; returns ``incoming``,
    ``incoming[r]`` being what rank ``r`` sent here (``outgoing`` itself for a single process).

    Two ``all_to_all_single`` calls: the byte counts, then the pickled bytes (variable splits), on
    ``device`` (where the group's backend needs its tensors: CPU for gloo, the GPU for NCCL).
    Tensors inside the objects should be on the CPU and own their storage (a view pickles its
    whole storage).
    """
    if group is None:
        return list(outgoing)
    world = world_size(group)
    if len(outgoing) != world:
        raise ValueError(f"exchange_objects: expected one object per rank ({world}), got {len(outgoing)}")
    payloads = [torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) for obj in outgoing]
    send_sizes = [p.numel() for p in payloads]
    sizes = torch.tensor(send_sizes, dtype=torch.long, device=device)
    recv_sizes_t = torch.empty_like(sizes)
    dist.all_to_all_single(recv_sizes_t, sizes, group=group)
    recv_sizes = recv_sizes_t.tolist()
    send = torch.cat(payloads).to(device)
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=group)
    data = recv.cpu().numpy().tobytes()
    incoming, start = [], 0
    for n in recv_sizes:
        incoming.append(pickle.loads(data[start:start + n]))
        start += n
    return incoming
