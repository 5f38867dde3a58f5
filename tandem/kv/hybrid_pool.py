"""The batched engine's pool for a hybrid target (Qwen3.5): K/V blocks and recurrent-state slots.

A hybrid target's attention layers keep K/V as any target's do, in the paged blocks of
`PagedKVPool` (one pool layer per attention layer). Its Gated DeltaNet layers keep a fixed-size
state per sequence instead: the last K - 1 conv inputs and the delta rule's matrix S per head.
This pool holds those beside the blocks, one *slot* per open sequence:

    conv[g]  [slots, conv_dim, K - 1]   model dtype
    delta[g] [slots, Hv, dk, dv]        fp32

A pass reads a sequence's slot and never writes it (every row of a tree walks its own root path
from the committed state, tandem.models.qwen3_5); it leaves a `TreeRecord` per sequence here,
and `commit_many` replays each accepted path from it into the slot, beside the blocks' commit.
So a step keeps no state per tree node, and a sequence's slot always holds its committed rows.

What that changes against PagedKVPool:
- prefix caching is off: a cached block's K/V is no use without the recurrent state after its
  rows, which no block keeps (a state per block boundary would cost a slot per block);
- a sequence opens with a zeroed slot and frees it on close: preemption (recompute) starts the
  state over with the prompt, abort and finish give the slot back;
- `check()` also finds a slot owned twice, leaked, or missing, and a record of a closed sequence.
"""
from __future__ import annotations

from collections import deque

import torch

from tandem.kv.paged import PagedKVPool, PoolExhausted


class _Gather:
    """Layer i of several slots, gathered on first use: [b, ...] (a list's indexing, read only)."""

    def __init__(self, tensors: list[torch.Tensor], idx: torch.Tensor):
        self.tensors, self.idx = tensors, idx

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tensors[i].index_select(0, self.idx)

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class HybridKVPool(PagedKVPool):
    def __init__(self, model, num_blocks: int, block_size: int, max_seqs: int):
        c = model.config
        super().__init__(len(c.attention_layers), c.num_key_value_heads, c.head_dim, num_blocks, block_size,
                         model.dtype, model.device, prefix_caching=False)
        blank = model.new_state(max_seqs)
        self.conv, self.delta = blank.conv, blank.delta  # per GDN layer [slots, ...] (see the module doc)
        self._state = type(blank)  # the model's RecurrentState record (the models layer sits above this one)
        self.num_slots = max_seqs
        self.free_slots: deque[int] = deque(range(max_seqs))
        self.slot_of: dict[str, int] = {}
        # each sequence's record of the last pass it had rows in (HybridBatchedModel.forward
        # replaces them all per pass), what its commit replays: (TreeRecord, its batch row in it;
        # a record shared by the pass's one-row decodes holds one batch row per sequence)
        self.records: dict[str, tuple[object, int]] = {}
        self._commit_state = model.commit_state

    # ---- lifecycle -------------------------------------------------------------------------
    def allocate(self, seq_id: str, tokens: list[int], max_cached: int) -> int:
        """Open a sequence with a zeroed state slot (no rows cached: prefix caching is off)."""
        if not self.free_slots:
            raise PoolExhausted(f"no recurrent-state slot free for {seq_id}: all {self.num_slots} are held "
                                "(the scheduler admits at most max_num_seqs requests)")
        rows = super().allocate(seq_id, tokens, max_cached)
        slot = self.free_slots.popleft()
        self.slot_of[seq_id] = slot
        for t in self.conv + self.delta:
            t[slot].zero_()
        return rows

    def free(self, seq_id: str) -> None:
        super().free(seq_id)
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        self.records.pop(seq_id, None)

    def state(self, seq_id: str):
        """The sequence's committed state as a RecurrentState of [1, ...] views of its slot."""
        s = self.slot_of[seq_id]
        return self._state([c[s:s + 1] for c in self.conv], [d[s:s + 1] for d in self.delta])

    def states(self, seq_ids: list[str]):
        """Several sequences' committed states, [b, ...] each: a RecurrentState whose layers are
        gathered from the slots when a GDN layer reads them (one layer's copy at a time)."""
        idx = torch.tensor([self.slot_of[s] for s in seq_ids], device=self.delta[0].device)
        return self._state(_Gather(self.conv, idx), _Gather(self.delta, idx))

    def commit_many(self, commits: list[tuple[str, list[int], list[int]]], keep_later: bool = False) -> None:
        """The blocks' commit (PagedKVPool), then each path replayed into its sequence's slot from
        the record of the pass that computed its rows: one replay per record (a shared record's
        sequences together, when their paths are alike), written back to the slots."""
        if keep_later:
            raise ValueError("a hybrid pool commits each pass before the next is planned (no async scheduling)")
        super().commit_many(commits)
        groups: dict[tuple[int, tuple[int, ...]], list[tuple[str, int]]] = {}
        held: dict[int, object] = {}
        for seq_id, path, _ in commits:
            if not path:
                continue
            record, row = self.records.pop(seq_id, (None, 0))
            assert record is not None, f"{seq_id}: committed rows that no pass of this pool computed"
            held[id(record)] = record
            groups.setdefault((id(record), tuple(path)), []).append((seq_id, row))
        for (rid, path), members in groups.items():
            record = held[rid]
            if len(members) == 1 and record.layers[0].k.shape[0] == 1:  # (a sequence's own record)
                self._commit_state(self.state(members[0][0]), record, list(path))  # (in place, into its slot)
                continue
            rows = torch.tensor([row for _, row in members], device=self.delta[0].device)
            slots = torch.tensor([self.slot_of[sid] for sid, _ in members], device=self.delta[0].device)
            st = self.states([sid for sid, _ in members])
            st.conv, st.delta = list(st.conv), list(st.delta)  # (gathered copies, committed in place)
            self._commit_state(st, record.rows(rows), list(path))
            for pool_t, new in zip(self.conv + self.delta, st.conv + st.delta):
                pool_t.index_copy_(0, slots, new)

    # ---- invariants ------------------------------------------------------------------------
    def check(self) -> list[str]:
        problems = super().check()
        owners = [0] * self.num_slots
        for sid in self.seqs:
            if sid not in self.slot_of:
                problems.append(f"{sid}: an open sequence without a recurrent-state slot")
        for sid, slot in self.slot_of.items():
            owners[slot] += 1
            if sid not in self.seqs:
                problems.append(f"{sid}: holds state slot {slot} but is not open")
        free = set(self.free_slots)
        if len(free) != len(self.free_slots):
            problems.append("a state slot is on the free list twice")
        for slot in range(self.num_slots):
            if owners[slot] > 1:
                problems.append(f"state slot {slot}: owned by {owners[slot]} sequences (double-owned)")
            if slot in free and owners[slot]:
                problems.append(f"state slot {slot}: free and owned (double-owned)")
            if slot not in free and not owners[slot]:
                problems.append(f"state slot {slot}: leaked (neither free nor owned)")
        for sid in self.records:
            if sid not in self.seqs:
                problems.append(f"{sid}: a pass record kept for a closed sequence")
        return problems
