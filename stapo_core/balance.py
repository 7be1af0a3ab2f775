"""Planning a forward of some of a batch's sequences over data-parallel ranks, balanced by tokens.

S2T's current-policy statistics are needed only for the sequences that can hold a candidate (a
positive advantage). Which sequences those are differs from rank to rank, so each rank's own share
can be far from the mean; :func:`plan_forward` moves them:

1. :func:`assign_by_tokens` spreads the sequences over the ranks by tokens; when that leaves the
   busiest rank no lighter than each rank forwarding its own sequences, nothing moves;
2. :func:`split_micro_batches` cuts each rank's share into micro-batches;
3. every rank is padded to the same number of micro-batches with a copy of the shortest sequence:
   a sharded model gathers its parameters collectively in every forward, so every rank must run
   the same number of them.

Pure python and deterministic: every rank computes the same plan from the same gathered lengths,
without further communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Item:
    """One sequence: the rank that holds it (``owner``), its row there (``index``), its length."""

    owner: int
    index: int
    tokens: int


@dataclass(frozen=True)
class ForwardPlan:
    """What each rank forwards.

    micro_batches: ``[rank][k]``, the items rank ``rank`` forwards in its ``k``-th micro-batch;
        every rank has the same number of micro-batches (none when there is no item at all).
    padding: ``[rank][k]``, True for a micro-batch that only keeps the ranks in step (it holds
        :attr:`dummy`; its results are discarded).
    dummy: the shortest item (ties: lowest owner, then index), or None without items.
    """

    micro_batches: tuple
    padding: tuple
    dummy: Optional[Item]

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches[0]) if self.micro_batches else 0

    def rank_tokens(self) -> list[int]:
        """Padding included."""
        return [sum(item.tokens for mb in rank for item in mb) for rank in self.micro_batches]


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"plan_forward: {name}={value!r} is invalid: expected an integer >= 1")
    return value


def _longest_first(items: Sequence[Item]) -> list[Item]:
    return sorted(items, key=lambda it: (-it.tokens, it.owner, it.index))


def assign_by_tokens(items: Sequence[Item], world: int) -> list[list[Item]]:
    """``[rank] -> items``: longest first, each to the least-loaded rank (a tie keeps an item on its
    owner, then takes the lowest rank). Each rank's list is longest first."""
    loads = [0] * world
    shares: list[list[Item]] = [[] for _ in range(world)]
    for item in _longest_first(items):
        rank = min(range(world), key=lambda r: (loads[r], r != item.owner, r))
        loads[rank] += item.tokens
        shares[rank].append(item)
    return shares


def split_micro_batches(items: Sequence[Item], *, max_rows: Optional[int] = None,
                        max_tokens: Optional[int] = None) -> list[list[Item]]:
    """``items`` (longest first) in micro-batches: chunks of ``max_rows`` in order, or first fit
    into bins of ``max_tokens`` (an item longer than the budget gets a bin of its own), or one
    micro-batch when neither is given. No micro-batch without items."""
    items = list(items)
    if not items:
        return []
    if max_tokens is not None:
        bins: list[list[Item]] = []
        loads: list[int] = []
        for item in items:
            for b, load in enumerate(loads):
                if load + item.tokens <= max_tokens:
                    bins[b].append(item)
                    loads[b] += item.tokens
                    break
            else:
                bins.append([item])
                loads.append(item.tokens)
        return bins
    if max_rows is not None:
        return [items[i:i + max_rows] for i in range(0, len(items), max_rows)]
    return [items]


def _busiest(shares: list[list[Item]]) -> int:
    return max(sum(it.tokens for it in share) for share in shares)


def plan_forward(items: Sequence[Item], world: int, *, max_rows: Optional[int] = None,
                 max_tokens: Optional[int] = None) -> ForwardPlan:
    """Every item forwarded once, the ranks' token loads balanced, the same number of micro-batches
    on every rank. ``items``: owners in ``[0, world)``, ``tokens >= 1``. ``max_rows`` / ``max_tokens``
    (at most one): the micro-batch limit in sequences, or in tokens (the dynamic batch size's budget)."""
    world = _check_positive_int("world", world)
    if max_rows is not None and max_tokens is not None:
        raise ValueError("plan_forward: give max_rows or max_tokens, not both")
    if max_rows is not None:
        _check_positive_int("max_rows", max_rows)
    if max_tokens is not None:
        _check_positive_int("max_tokens", max_tokens)
    for item in items:
        if not 0 <= item.owner < world:
            raise ValueError(f"plan_forward: item {item} has an owner outside [0, {world})")
        _check_positive_int(f"tokens of {item}", item.tokens)
    if not items:
        return ForwardPlan(micro_batches=tuple(() for _ in range(world)),
                           padding=tuple(() for _ in range(world)), dummy=None)
    dummy = min(items, key=lambda it: (it.tokens, it.owner, it.index))
    moved = assign_by_tokens(items, world)
    own = [_longest_first([it for it in items if it.owner == r]) for r in range(world)]
    shares = moved if _busiest(moved) < _busiest(own) else own
    split = [split_micro_batches(share, max_rows=max_rows, max_tokens=max_tokens) for share in shares]
    count = max(len(mbs) for mbs in split)
    micro_batches = tuple(tuple(tuple(mb) for mb in mbs) + ((dummy,),) * (count - len(mbs)) for mbs in split)
    padding = tuple((False,) * len(mbs) + (True,) * (count - len(mbs)) for mbs in split)
    return ForwardPlan(micro_batches=micro_batches, padding=padding, dummy=dummy)


__all__ = ["ForwardPlan", "Item", "assign_by_tokens", "plan_forward", "split_micro_batches"]
