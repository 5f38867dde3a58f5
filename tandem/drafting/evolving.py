"""Evolving tree cache (SwiftSpec s3.2): the draft worker's tree, kept across target passes.

The draft's KV cache (tandem.kv.cache.KVCache) keeps SwiftSpec's invariant:

    [ verified prefix: every verified token the draft has fed, the root last | tree region | free ]

The tree hangs from the **root** (node 0), the last verified token. Its K/V is the last
prefix row once fed; until then it waits in `pending` with the other verified tokens the
draft has not fed yet. Every other node is a draft token, either

- **fed** (`row[i] >= 0`): its K/V sits in tree-region row `row[i]` and its `width` most
  probable children have been added as nodes; or
- a **candidate** (`row[i] == -1`): a child proposed by its (fed) parent, not fed yet.

So the best-first priority queue of SwiftSpec s3.1.3 is simply "the candidates, by `logp`".
One expansion round feeds the `width` most probable candidates together (one draft step with
the non-square mask of Figure 3: new rows x [prefix | tree region]); each gets its children.

Node arrays are flat lists in topological order (parents[i] < i): tokens, parents, logp
(cumulative draft log-prob from the root, root 0.0), depth (root 0), row. A node at depth k
has position `root_position + k`, where the root sits at prefix row `prefix_len - 1`.

`reroot(verified)` walks the verified tokens (accepted draft tokens + bonus) down the tree:

- every matched fed node moves into the prefix and, when the last verified token is a fed node,
  its whole fed subtree stays in the tree region in its old row order, all by one gather
  (`KVCache.commit(path_rows, keep=subtree_rows)`): no K/V is recomputed;
- otherwise the tree region is dropped and a new tree starts at the last verified token, which
  (with any matched-but-unfed token before it) waits in `pending` to be fed.

`select(n)` returns the n most probable nodes (prefix-closed: a child is never more probable
than its parent, and ties break on index) as a `DraftTree` for the target.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from tandem.drafting.device_rounds import DeviceRounds
from tandem.kernels.resident import topk_logprobs
from tandem.runtime.runner import ModelRunner
from tandem.tree.draft_tree import DraftTree, children_of


_VERSIONS = itertools.count(1)  # tree versions, unique across trees (see EvolvingTree.version)


@dataclass(frozen=True)
class Reroot:
    """What one re-root did. `hit`: the last verified token was a node of the tree."""

    matched: int  # verified tokens found along one tree path
    hit: bool
    reused: int  # fed nodes whose K/V stay in the tree region (the surviving subtree)
    dropped: int  # fed nodes whose K/V were dropped
    kept_nodes: int  # nodes (fed or candidate) of the surviving subtree, its root excluded


@dataclass
class EvolvingTree:
    runner: ModelRunner
    width: int  # w: candidates fed per expansion round, and children added per fed node
    max_rows: int | None = None  # cap on the tree region (fed nodes); None: the cache's capacity
    tokens: list[int] = field(default_factory=list)  # [n]
    parents: list[int] = field(default_factory=list)  # [n], -1 for the root
    logp: list[float] = field(default_factory=list)  # [n] cumulative draft log-prob from the root
    depth: list[int] = field(default_factory=list)  # [n] root 0
    row: list[int] = field(default_factory=list)  # [n] tree-region row if fed, -1 if candidate (root: -1)
    pending: list[int] = field(default_factory=list)  # verified tokens not fed yet; the root last
    prefix_tokens: list[int] = field(default_factory=list)  # tokens whose K/V are the prefix rows
    steps: int = 0  # draft forward passes
    version: int = 0  # renewed by every change to the nodes or the cache (device rounds reload on a change)
    # expansion rounds on the device, many per host sync (tandem.drafting.device_rounds);
    # False: every round on the host (`expand`), one sync each
    device_rounds: bool = True
    _dev: DeviceRounds | None = field(default=None, repr=False)
    _root_logits: torch.Tensor | None = field(default=None, repr=False)  # [vocab], see feed_pending

    @property
    def cache(self):
        return self.runner.cache

    def __len__(self) -> int:
        return len(self.tokens)

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self, prompt: list[int]) -> None:
        """Empty the cache; the prompt waits to be fed and its last token is the root."""
        self.touch()
        self.cache.truncate(0)
        self.prefix_tokens = []
        self.pending = list(prompt)
        self._new_tree(prompt[-1])

    @property
    def root_fed(self) -> bool:
        return not self.pending

    def feed_pending(self, add_children: bool = True, defer: bool = False) -> None:
        """Feed the pending verified tokens into the prefix (causal); the root gets its children.

        `defer`: keep the root's logits on the device and let the next device rounds add its
        children (saves the host sync of reading them); `_settle` adds them on the host if no
        device round comes first."""
        if not self.pending:
            return
        self.touch()
        assert self.cache.tree_len == 0, "pending tokens with a live tree region"
        self.steps += 1
        logits = self.runner.prefill(self.pending)  # [vocab] after the root
        self.prefix_tokens += self.pending
        self.pending = []
        if add_children:
            if defer:
                self._root_logits = logits.clone()  # the runner's output buffer is reused by its next step
            else:
                self._add_children([0], logits[None])

    def expand(self) -> int:
        """One expansion round: feed the `width` most probable candidates. Returns nodes fed."""
        assert self.root_fed, "feed_pending() before expanding"
        self._settle()
        cand = self.candidates()
        room = self.runner.capacity - self.cache.length
        if self.max_rows is not None:
            room = min(room, self.max_rows - self.cache.tree_len)
        n = min(self.width, len(cand), room)
        if n <= 0:
            return 0
        leaves = sorted(cand, key=lambda i: (-self.logp[i], i))[:n]
        self.feed(leaves)
        return n

    def expand_rounds(self, rounds: int) -> int:
        """Up to `rounds` expansion rounds; returns how many ran. On the device path all of them
        cost one host sync; the host path (`expand`) covers what the device path cannot (fewer
        than w candidates, or room for less than a full round)."""
        assert self.root_fed, "feed_pending() before expanding"
        dev = self._device()
        deferred = self._root_logits is not None  # the root's children are still to be added
        if dev is not None and rounds > 0 and (deferred or len(self.candidates()) >= self.width):
            extra = self.width if deferred else 0
            r = min(rounds, dev.rounds_possible(self, extra))
            if r > 0:
                dev.load(self, self._root_logits)
                self._root_logits = None
                dev.run(self, r)
                dev.fetch(self, r, extra)
                return r
        self._settle()
        n = 0
        while n < rounds and self.expand():
            n += 1
        return n

    def grow(self, nodes: int, fed: int = 0, max_rounds: int = 64) -> None:
        """Feed pending tokens, then expand until the tree offers `nodes` draft nodes and `fed` of
        its nodes are fed (expanded). Method `tree` asks for depth x width fed nodes per tree, and
        `async` for as many, so its trees are as deep (candidates alone reach N nodes after two
        rounds, and a tree that shallow halves acceptance)."""
        self.feed_pending(defer=self._device() is not None)
        w = self.width
        for _ in range(max_rounds):
            deferred = w if self._root_logits is not None else 0
            need_nodes = nodes - (len(self.tokens) - 1 + deferred)  # a round adds w * w nodes
            need_fed = fed - self.cache.tree_len  # ... and feeds w
            if need_nodes <= 0 and need_fed <= 0:
                break
            if not self.expand_rounds(max(-(-need_nodes // (w * w)), -(-need_fed // w), 1)):
                break
        self._settle()

    def touch(self) -> int:
        """Mark a change (a new version, unique across trees); returns it."""
        self.version = next(_VERSIONS)
        return self.version

    def candidates(self) -> list[int]:
        """Nodes not fed yet (the root excluded), in index order."""
        return [i for i in range(1, len(self.tokens)) if self.row[i] < 0]

    def select(self, nodes: int) -> DraftTree:
        """The `nodes` most probable draft nodes under the root, prefix-closed, as a DraftTree."""
        self._settle()
        # NOTE: device rounds keep children of probability 0 as nodes (log-prob -inf); never send them
        ranked = sorted((i for i in range(1, len(self.tokens)) if self.logp[i] > float("-inf")),
                        key=lambda i: (-self.logp[i], i))[:nodes]
        keep = [0] + sorted(ranked)
        return DraftTree(tokens=list(self.tokens), parents=list(self.parents), logp=list(self.logp)).subset(keep)

    # ---- building blocks (public so tests can build the paper's trees by hand) -----------
    def add_node(self, parent: int, token: int, logp: float) -> int:
        """Append a candidate node under `parent` (logp is cumulative from the root)."""
        self.touch()
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.logp.append(float(logp))
        self.depth.append(self.depth[parent] + 1)
        self.row.append(-1)
        return len(self.tokens) - 1

    def feed(self, nodes: list[int], add_children: bool = True) -> torch.Tensor:
        """Feed candidate nodes (whose parents are fed) in one draft step; returns logits [n, vocab]."""
        self.touch()
        cache = self.cache
        base = cache.tree_len
        for j, i in enumerate(nodes):
            assert self.row[i] < 0 and (self.parents[i] == 0 or self.row[self.parents[i]] >= 0), i
            self.row[i] = base + j
        # Non-square mask (SwiftSpec Figure 3): new rows x tree region (the prefix is implicit).
        mask = torch.zeros(len(nodes), base + len(nodes), dtype=torch.bool)  # [n, tree_len + n]
        for j, i in enumerate(nodes):
            mask[j, self.ancestor_rows(i)] = True
        root_pos = cache.prefix_len - 1
        self.steps += 1
        logits = self.runner.step([self.tokens[i] for i in nodes], [root_pos + self.depth[i] for i in nodes], mask)
        if add_children:
            self._add_children(nodes, logits)
        return logits

    def ancestor_rows(self, i: int) -> list[int]:
        """Tree-region rows of node i and its ancestors below the root (the root is a prefix row)."""
        rows = []
        while i > 0:
            rows.append(self.row[i])
            i = self.parents[i]
        return rows[::-1]

    def children(self) -> list[list[int]]:
        return children_of(self.parents)

    # ---- re-root --------------------------------------------------------------------------
    def reroot(self, verified: list[int]) -> Reroot:
        """Advance past `verified` (the target's accepted tokens then its bonus token)."""
        self.touch()
        assert self.root_fed and verified, "re-root needs a fed root and at least the bonus token"
        self._settle()
        children = self.children()
        path: list[int] = []
        node = 0
        for t in verified:
            nxt = next((c for c in children[node] if self.tokens[c] == t), None)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        hit = len(path) == len(verified)
        fed_path = [c for c in path if self.row[c] >= 0]  # every matched node but possibly the last
        total_fed = self.cache.tree_len
        if hit and self.row[node] >= 0:
            sub = self._descendants(node, children)  # index (= topological) order
            kept_fed = sorted((c for c in sub if self.row[c] >= 0), key=lambda c: self.row[c])
            self.cache.commit([self.row[c] for c in fed_path], keep=[self.row[c] for c in kept_fed])
            self.prefix_tokens += [self.tokens[c] for c in fed_path]
            new_row = {c: r for r, c in enumerate(kept_fed)}
            order = [node] + sub
            remap = {old: new for new, old in enumerate(order)}
            base_lp, base_d = self.logp[node], self.depth[node]
            self.tokens = [self.tokens[c] for c in order]
            self.parents = [-1] + [remap[self.parents[c]] for c in sub]
            self.logp = [self.logp[c] - base_lp for c in order]
            self.depth = [self.depth[c] - base_d for c in order]
            self.row = [-1] + [new_row.get(c, -1) for c in sub]
            return Reroot(len(path), True, len(kept_fed), total_fed - len(fed_path) - len(kept_fed), len(sub))
        # The last verified token is not a fed node: a new tree starts at it.
        self.cache.commit([self.row[c] for c in fed_path])
        self.prefix_tokens += [self.tokens[c] for c in fed_path]
        unfed = [self.tokens[c] for c in path if self.row[c] < 0]
        self.pending = unfed + list(verified[len(path):])
        self._new_tree(verified[-1])
        return Reroot(len(path), hit, 0, total_fed - len(fed_path), 0)

    def check(self) -> None:
        """Assert the invariants (used by tests): topology, depths, rows <-> tree region."""
        self._settle()
        n = len(self.tokens)
        assert len(self.parents) == len(self.logp) == len(self.depth) == len(self.row) == n >= 1
        assert self.parents[0] == -1 and self.depth[0] == 0 and self.logp[0] == 0.0 and self.row[0] == -1
        for i in range(1, n):
            p = self.parents[i]
            assert 0 <= p < i and self.depth[i] == self.depth[p] + 1
            assert p == 0 or self.row[p] >= 0, "a node's parent must be fed"
            assert self.logp[i] <= self.logp[p] + 1e-6
        rows = sorted(r for r in self.row if r >= 0)
        assert rows == list(range(self.cache.tree_len)), (rows, self.cache.tree_len)
        if self.pending:
            assert self.cache.tree_len == 0 and n == 1 and self.pending[-1] == self.tokens[0]
        else:
            assert self.prefix_tokens and self.prefix_tokens[-1] == self.tokens[0]
        assert len(self.prefix_tokens) == self.cache.prefix_len
        # siblings carry distinct tokens, so walking verified tokens down the tree is unambiguous
        sib = {(self.parents[i], self.tokens[i]) for i in range(1, n)}
        assert len(sib) == n - 1, "two siblings share a token"

    # ---- internals ------------------------------------------------------------------------
    def _settle(self) -> None:
        """Add the root's deferred children on the host (see feed_pending)."""
        if self._root_logits is not None:
            logits, self._root_logits = self._root_logits, None
            self._add_children([0], logits[None])

    def _device(self) -> DeviceRounds | None:
        if not self.device_rounds:
            return None
        if self._dev is None:
            # NOTE: kept on the runner, like its graphs: a tree lives for one request, and
            # capturing the round's graphs again for every request would cost more than it saves
            rows = self.max_rows if self.max_rows is not None else self.runner.capacity
            key = ("device-rounds", self.width, rows)
            self._dev = self.runner.attached.get(key)
            if self._dev is None:
                self._dev = self.runner.attached[key] = DeviceRounds(
                    self.runner, self.width, max_nodes=1 + self.width * (rows + 2), max_rows=rows)
        return self._dev

    def _new_tree(self, root_token: int) -> None:
        self.tokens, self.parents, self.logp, self.depth, self.row = [int(root_token)], [-1], [0.0], [0], [-1]

    @staticmethod
    def _descendants(node: int, children: list[list[int]]) -> list[int]:
        out, stack = [], list(children[node])
        while stack:
            c = stack.pop()
            out.append(c)
            stack.extend(children[c])
        return sorted(out)

    def _add_children(self, parents: list[int], logits: torch.Tensor) -> None:
        # logits: [len(parents), vocab]
        top_lp, top_tok = topk_logprobs(logits, min(self.width, logits.shape[-1]))
        top_lp, top_tok = top_lp.tolist(), top_tok.tolist()  # one device sync per round
        for j, p in enumerate(parents):
            for lp, tok in zip(top_lp[j], top_tok[j]):
                if lp > float("-inf"):
                    self.add_node(p, tok, self.logp[p] + lp)
