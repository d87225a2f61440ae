"""Layout rules that reshapes imply: a dim a reshape makes inherits the split of its source.

A merge ``[height, width] -> [(height width)]`` whose outermost part (of size > 1) is
split keeps that split on the merged dim without moving data, and a split
``height -> [hp, ph]`` keeps it on the outer factor (:mod:`.reshape`).  Mesh-TF asks
the layout to say so (``height:data; height_width:data``); here a dim that no written
rule names gets the split its reshape carries over, as an *implied* rule:

* ``height:data`` alone implies ``height_width:data`` (``from height``), and
  ``hp:data`` for ``height = (hp ph)``; ``height:(x,y)`` implies ``hp:x; ph:y``
  where ``x`` fills ``hp``;
* a rename of a dim whose rule is implied passes it on (a patchify's
  ``hp_wp`` renamed ``patches``).  A rename of a dim the user split passes the split
  on to the dim the rename makes (no op before it has that dim; a causal mask, made from dim
  sizes alone, does not count) where no op holds the
  two dims together and the layout gives those axes to no other dim of its output: an
  MoE's ``batch`` renamed ``expert_batch`` for its experts keeps the tokens on their
  shard under ``batch:data`` alone (they were gathered to every rank).  Otherwise a
  rename moves a split as the layout says (Mesh-TF's expert parallelism: under
  ``experts:data``, one alltoall each way), and a dim that meets the old one (keys'
  ``key_seq`` against queries' ``seq``, CLIP's texts against its images) is whole
  unless its own rule splits it, or a sliding-window attention reads it as its keys (Gemma 3's
  local layers beside global ones: a halo each, the global ones gather at the attention); an
  implied split passes on by the same rule (ViT's ``patches`` under ``height:data``: its keys'
  ``key_patches`` stay whole, gathered once by the rename and saved for the backward, where split
  they were gathered again there).  Nor does a rename carry a split into a dim a concat joins
  from several parts, or an implied one out of it (:func:`_joins_parts`: a part sits at an offset
  of the joined dim, so their even splits differ).  Back the other way, a dim renamed to one
  the layout splits takes that split where no param holds it, no op holds the two and no other dim of the
  rename's input has those axes (FCOS's stem ``height`` renamed ``row``, under ``row:data``:
  the stem ran whole and the rename's gradient was gathered).  A param may hold the old dim
  where no forward op mixes its positions (sums over it, needs it whole, renames it to a third
  dim): FT-Transformer's per-feature weights ``[num_feat, d_model]`` make the numeric tokens
  renamed ``tok``; under ``tok:model`` they are stored split like the tokens they make, and the
  tokens' gradient is no longer gathered for theirs.  There the split may be uneven (a rename
  keeps sizes: the parts are the written dim's, which strict splits refuse), as it may be for
  keys renamed from a split ``seq`` that only sliding-window attentions mix (a halo each);
* a dim a reshape takes apart gets the written split of the output dim that is its outer
  part (Whisper's ``frames`` cut into ``(seq two)`` under ``seq:model``; a flat fused qkv
  weight's dim ``(heads qkv d_head)`` under ``heads:model``), so the split crosses the
  reshape both ways; where the split dim is an inner part (GPT-2's ``(qkv heads d_head)``) no
  contiguous split reaches it, but a block-cyclic one does (``F:model[cyclic 3]``, rank r its
  heads' rows of q, of k and of v), implied where every op holding the dim allows it
  (:mod:`.cyclic_dims`); else nothing is implied (the plan notes it, :mod:`.reshape`).  Where
  the reshapes cut slices of such a dim (nanoGPT's q, k, v sliced off ``F``, each ``(heads
  d_head)``), the split they carry to the slices is plain and the full dim is block-cyclic,
  one block per rank of each slice (:func:`.cyclic_dims.cyclic_entry`);
* chains of reshapes are followed to a fixpoint.

Only the forward graph is read (repeat blocks included): the backward's reshapes
map the new dims back and then find both sides split, so they move nothing.  An
implied rule is global: none is made for a dim with a written global rule, and a
written scoped rule (``params.hw:fsdp``) still wins for its tensors.  It ranks after
every written rule where two dims of a tensor contend for an axis, and none is made
where its axes would not divide the dim (a rename's: would leave a part empty) or would split
two dims of a param or input
(those layouts are errors), nor for a dim a repeat scans (an SSD's ``chunk`` cut from a split
``seq``: an inner repeat runs its steps in turn on every rank, so that dim stays whole, and the
reshape gathers its input instead), nor from one (a pipeline's stage axis splits the layer dim
alone: an activation renamed to the layer dim, stacked into the repeat, is made whole and cut).
Where reshapes of one source carry its split to two dims an op holds together (BigBird's
``(blk pos)`` blocks, and its one global block, whose ``blk`` is 1, so ``pos`` takes the split
there), the axes go to the dim whose reshapes keep more elements split, and the other gets no
rule, even where that dim's slices or concats (``blk`` 5 and 1) are split unevenly or kept whole
(not under strict splits: :func:`_outvoted`), but not where a reshape makes it at a size the axes
leave uneven (a reshape carries no uneven split: TimesNet's folds of ``time`` into ``cycles`` 20
and 15, where the unfolds' ``cycles_period`` keeps the split instead).  The plan lists each implied rule in its notes.
"""
from __future__ import annotations

from functools import cached_property

from ..core.names import Name
from ..errors import LayoutError
from ..layout.layout import Layout
from ..layout.specs import Rule
from .cyclic_dims import cyclic_entry
from .reshape import Regroup

RESHAPES = ("reshape", "rearrange")
LEAVES = ("param", "input", "placeholder")


def _sides(n) -> tuple:
    """The tensors of node ``n`` whose dims meet: all of them, except a sliding-window attention's
    query side (q, its output, gradient and logsumexp) and key side (k, v, their gradients), apart:
    each rank reads only a halo of the keys near its queries, so under ``seq:model`` the keys renamed
    from ``seq`` keep its split (:mod:`.attention`) rather than being gathered by the rename."""
    ts = (*n.inputs, *n.outputs)
    if n.op.name not in ("attention", "attention_backward") or n.attrs.get("window") is None:
        return (ts,)
    keys = n.inputs[1:3] if n.op.name == "attention" else (*n.inputs[2:4], *n.outputs[1:])   # k, v (dk, dv)
    ids = {id(t) for t in keys}
    return tuple(t for t in ts if id(t) not in ids), tuple(keys)


class _Graph:
    """What the derivation reads of a graph: its forward reshapes and renames in build
    order, its leaves (params, inputs, a block's placeholders, except those of values made in
    the graph: a closed-over mask is laid out as the value it stands for, two dims contending for
    an axis by rank), every size of each dim."""

    def __init__(self, nodes):
        self.movers, self.leaves, self.params, self.nodes, self.forward = [], [], [], [], []
        self.closed: dict[int, object] = {}   # a block's closed-over placeholder -> the tensor it stands for
        self.scanned: set[str] = set()   # the dims repeats scan: whole unless a written rule splits them
        self._walk(nodes, forward=True)

    def mixes(self, dim: str, into: str) -> bool:
        """Whether some forward op (a block's included) mixes the positions of ``dim``: sums or
        takes the max over it, needs it whole (a concat, a window, attention's keys), or
        renames it to a dim other than ``into`` (a vision tower's ``patches`` to its keys'
        ``key_patches``).  Elementwise math and einsums that keep the dim do not."""
        for n in self.forward:
            if n.op.subgraphs(n) or not any(dim in t.shape.names for t in n.inputs):
                continue
            if n.op.name == "rename":
                if n.attrs["mapping"].get(dim, into) != into:
                    return True
                continue
            spec = n.op.spec(n)
            if dim in spec.fixed or dim in spec.reduce:
                return True
        return False

    def meet(self, a: str, b: str) -> bool:
        """Whether some op of the graph (backward included) reads or makes dims ``a`` and ``b``
        both: a fused attention meets its queries' ``seq`` and its keys' ``key_seq`` though no
        tensor holds the two.  A rename (which maps one to the other) and an op running a
        block (a ``repeat``: its block's ops are read instead) do not count."""
        return any(a in names and b in names for names in self.dim_sets)

    def first(self, dim: str):
        """The first op in build order (a block's ops, not the op running the block) that reads
        or makes ``dim``: a rename that is its first makes the dim.  Ops that make a value from dim
        sizes alone (a causal mask: iotas compared) hold none of the dim's data and make their
        part at any layout, so they do not count: Griffin's decay matrix masks ``[seq, key_seq]``
        (the mask hoisted before the block), and the rename that makes ``key_seq`` still passes on
        ``seq``'s split to the window attention's keys."""
        return self.first_ops.get(dim)

    @cached_property
    def first_ops(self) -> dict:
        out: dict = {}
        sized: set[int] = set()   # values made from dim sizes alone
        for n in self.nodes:
            stands_for = self.closed.get(id(n.outputs[0])) if n.op.name == "placeholder" else None
            if (n.op.name not in LEAVES and all(id(t) in sized for t in n.inputs)
                    or stands_for is not None and id(stands_for) in sized):
                sized.update(id(t) for t in n.outputs)
            elif not n.op.subgraphs(n):
                for t in (*n.inputs, *n.outputs):
                    for d in t.shape.names:
                        out.setdefault(d, n)
        return out

    @cached_property
    def dim_sets(self) -> set[frozenset[str]]:
        return {frozenset(d for t in ts for d in t.shape.names)
                for n in self.nodes if n.op.name != "rename" and not n.op.subgraphs(n) for ts in _sides(n)}

    @cached_property
    def joined(self) -> set[str]:
        """The dims a forward ``concat`` joins from several parts (a repeat's carries joined as one)."""
        return {n.attrs["dim"] for n in self.forward if n.op.name == "concat" and len(n.inputs) > 1}

    def _walk(self, nodes, forward: bool) -> None:
        for n in nodes:
            fwd = forward and n.phase == "forward"
            if fwd and n.op.name in RESHAPES + ("rename",):
                self.movers.append(n)
            if fwd:
                self.forward.append(n)
            made = self.closed.get(id(n.outputs[0])) if n.op.name == "placeholder" else None
            if n.op.name in LEAVES and (made is None or made.node.op.name in LEAVES):
                self.leaves.append(n.outputs[0])
            if n.op.name in ("repeat", "repeat_grad"):
                self.scanned.add(n.attrs["layer"].name)
                blk = n.attrs["block"]
                self.closed.update((id(ph), t) for ph, t in zip(blk.closed.values(), blk.outer))
            if n.op.name in ("param", "placeholder"):   # (a block's operand may be a stacked param)
                self.params.append(n.outputs[0])
            self.nodes.append(n)
            for graph, _ in n.op.subgraphs(n):
                self._walk(graph.nodes, fwd)

    @cached_property
    def sizes(self) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for n in self.nodes:
            for t in n.outputs:
                for d in t.shape:
                    out.setdefault(d.name, set()).add(d.size)
        return out


def implied_layout(nodes, mesh, layout: Layout, strict: bool = False) -> Layout:
    """``layout`` with the rules the forward graph's reshapes imply (see the module docstring).

    Args:
      nodes: the graph's nodes (those the plan computes), in build order.
      mesh: the mesh (a ``Mesh``).
      layout: the written layout.
      strict: splits are strict (``compile(strict_splits=True)``): no uneven rule is implied, so
        the refusal names the dim the user split.

    Returns:
      ``layout.with_implied(...)``; ``layout`` itself where nothing is implied.
    """
    g = _Graph(nodes)
    named = {r.key[1] for r in layout.rules if r.key[0] is None}
    if not any(n.op.name in RESHAPES or {*n.attrs["mapping"], *n.attrs["mapping"].values()} & named
               for n in g.movers):
        return layout
    implied: dict[str, tuple[Rule, str]] = {}
    cyclic: dict[str, tuple] = {}   # implied dims split block-cyclically: (dim, blocks per rank, at size)
    votes = _votes(g, mesh, layout)
    lost: set[str] = set()   # dims that lost their axes to a dim more reshapes keep split
    grew = True
    while grew:   # each pass adds a rule or ends; a dim gets at most one
        grew = False
        for node in g.movers:
            cur = layout.with_implied(tuple(implied.values()), tuple(cyclic.values()))
            for dim, axes, src, *blocks in (*_carried(node, mesh, cur, implied, g), *_drawn(node, mesh, cur),
                                            *_renamed_back(node, cur, g)):
                v, entry = blocks[0] if blocks else 1, None
                if node.op.name in RESHAPES and dim not in named and dim not in implied:
                    size = next(t.shape.get(dim).size for t in (*node.inputs, *node.outputs) if dim in t.shape.names)
                    entry = cyclic_entry(g.nodes, dim, size, v, mesh, axes, cur, g.sizes.get(dim, {size}))
                if v > 1 and not entry:
                    continue   # (a block-cyclic split: only where every op holding the dim allows it)
                uneven_ok = not strict and _uneven_ok(node, dim, g)
                # a dim a repeat scans neither takes a split (it stays whole) nor passes its own on
                # (a pipeline's stage axis splits the layer dim alone)
                scans = dim in g.scanned or any(d in g.scanned for d in src.split(", "))
                if dim in named or dim in implied or scans or dim in lost:
                    continue
                if not _fits(dim, axes, g, mesh, cur, uneven_ok):
                    continue
                rival = _outvoted(node, dim, axes, votes, g, mesh, cur, strict)
                if rival is not None and v > 1:
                    continue
                if rival is not None:   # a dim more reshapes keep split takes the axes instead
                    entry = None
                    lost.add(dim)
                    if rival in implied or rival in named:
                        continue
                    src = (f"{src}: its reshapes keep {votes[rival, tuple(axes)]} elements split "
                           f"under {rival}, {votes.get((dim, tuple(axes)), 0)} under {dim}")
                    dim = rival
                rule = Rule(None, Name(dim, None), tuple(Name(a, None) for a in axes))
                cut = f", block-cyclic: {entry[1]} blocks per rank" if entry else ""
                if entry and v == 1:   # (its reshapes cut slices of one group: nanoGPT's q, k, v)
                    cut += f" at its size {entry[2]}, 1 at {size}: each slice of whole groups is local"
                implied[dim] = (rule, f"implied by {node.op.name}: {rule} (from {src}{cut})")
                if entry:
                    cyclic[dim] = entry
                cur = layout.with_implied(tuple(implied.values()), tuple(cyclic.values()))
                grew = True
    return layout.with_implied(tuple(implied.values()), tuple(cyclic.values()))


def _carried(node, mesh, layout: Layout, implied: dict, g: _Graph):
    """``(dim, axes, source dims)`` for each new output dim of ``node`` that its input's split reaches."""
    t, out = node.inputs[0], node.outputs[0]
    if node.op.name == "rename":   # a written split: only to a dim it makes that never meets the old one
        written = {r.key[1]: r.axis_names for r in layout.rules if r.key[0] is None}
        moved_to = {a for d in out.shape.names if d in written for a in written[d]}   # the layout's own move
        for old, new in node.attrs["mapping"].items():
            if _meets_a_twin(g, old, new) or _joins_parts(g, old, new, implied):
                continue
            if old in implied and (not g.meet(old, new) or _window_keys(g, new, old)):
                yield new, implied[old][0].axis_names, old
            elif old in written and g.first(new) is node and (not g.meet(old, new) or _window_keys(g, new, old)) \
                    and not moved_to & set(written[old]):
                yield new, written[old], old
        return
    try:
        split = layout.targets(t.shape, t.scopes, mesh, t.name, False)[0][0].split
    except LayoutError:
        return   # a written rule that does not fit: the lowering reports it
    if not split:
        return
    got = Regroup.of(node).map(mesh, dict(split), "drop", layout.cyclic_blocks_of(t.shape, out.shape))[-1]
    for d in out.shape:
        axes = got.get(d.name)
        if axes and d.name not in t.shape.names:   # a dim the reshape made, not one it passes through
            yield d.name, axes, ", ".join(n for n, ax in split.items() if set(ax) & set(axes))


def _meets_a_twin(g: _Graph, old: str, new: str) -> bool:
    """Whether another forward rename makes a dim from ``old`` that meets ``new``: Nystromformer's
    landmark queries ``lq`` and keys ``lk``, both segment means of ``seq``, meet in their ``[lq, lk]``
    kernel and its pseudo-inverse's products.  One axis cannot split both, and either alone is
    resharded at every product of the two (94 allgathers a step under ``seq:model``): both stay whole."""
    return any(n.op.name == "rename" and n.attrs["mapping"].get(old, new) != new
               and g.meet(new, n.attrs["mapping"][old]) for n in g.movers)


def _joins_parts(g: _Graph, old: str, new: str, implied: dict) -> bool:
    """Whether a rename of ``old`` to ``new`` would carry a split into a dim a concat joins from
    several parts, or an implied one out of it: a part sits at an offset of the joined dim, so an
    even split of the part is not the joined dim's (the concat trades rows), and the joined dim's
    is not its other parts' (a repeat whose carries ``p`` and ``q`` are joined as ``s``: under
    ``p:model``, ``s`` and then ``q`` took the split, 18 permutes a step where ``s:model`` made 4
    allgathers).  A written rule on either keeps its split where the user wrote it."""
    return new in g.joined or (old in g.joined and old in implied)


def _drawn(node, mesh, layout: Layout):
    """``(dim, axes, source dims)`` for each input dim of reshape ``node`` that the written split
    of the output dims it becomes carries back to (a split output dim is its outer part).

    Whisper's stride-2 conv cuts ``frames`` into ``(seq two)``: under ``seq:model`` the frames
    were whole and the rearrange's gradient gathered ``seq``; with ``frames:model`` the split
    crosses the rearrange both ways and the convs before it trade halo rows instead.  A param
    holding the dim is stored split there as for a written rule: a flat qkv weight stored per
    head, ``(heads qkv d_head)``, is then column-parallel under ``heads:model``.
    """
    if node.op.name not in RESHAPES:
        return
    t, out = node.inputs[0], node.outputs[0]
    written = {r.key[1]: r.axis_names for r in layout.rules if r.key[0] is None}
    split = {d: written[d] for d in out.shape.names if d in written and d not in t.shape.names}
    if not split:
        return
    back, found = Regroup.of(node).inverse(), {}
    cyclic = layout.cyclic_blocks_of(t.shape, out.shape)
    got = back.map(mesh, split, "strict") or back.map(mesh, split, "strict", cyclic, found)
    if got is None:
        return
    for d in t.shape:
        axes = got[-1].get(d.name)
        # an axis written on two of the parts (``half:x; two:x``) cannot split the merged dim twice
        if axes and len(set(axes)) == len(axes) and d.name not in out.shape.names:
            yield d.name, axes, ", ".join(n for n, ax in split.items() if set(ax) & set(axes)), found.get(d.name, 1)


def _renamed_back(node, layout: Layout, g: _Graph):
    """``(dim, axes, source dim)`` for each dim rename ``node`` renames to a dim the layout splits,
    where no op holds the two and no other dim of the rename's input has those axes, and no param
    (nor a block's operand) holds the old dim unless no forward op mixes its positions
    (:meth:`_Graph.mixes`): the split reaches back to the ops before the rename.

    FCOS renames its stem conv's ``height`` to the grid's ``row``: under ``row:data`` the stem ran
    whole on every rank and the rename's gradient was allgathered; with ``height:data`` the stem
    runs on each rank's rows (its convs trade halo rows) and nothing is gathered.
    """
    if node.op.name != "rename":
        return
    written = {r.key[1]: r.axis_names for r in layout.rules if r.key[0] is None}
    names = node.inputs[0].shape.names
    for old, new in node.attrs["mapping"].items():
        axes = written.get(new)
        if not axes or g.meet(old, new):
            continue
        if any(old in t.shape.names for t in g.params) and g.mixes(old, new):
            continue   # (the param, stored split, would be gathered where its dim mixes)
        if not any(set(axes) & set(written.get(d, ())) for d in names if d != old):
            yield old, axes, new


def _uneven_ok(node, dim: str, g: _Graph) -> bool:
    """Whether rename ``node`` may pass its written split back to ``dim`` unevenly (its parts are
    the written dim's, which strict splits refuse): where a param holds ``dim`` and no forward op
    mixes its positions, so each rank makes its part of the renamed tensor from its own rows of
    the param, and their gradients from its own rows (FT-Transformer's per-feature tokens).
    Forward, a rename may pass it on unevenly to the keys of a sliding-window attention
    (:func:`_window_keys_only`).  Elsewhere (an MoE's ``expert_batch``, a conv's rows) an uneven
    split measured dearer."""
    mapping = node.attrs["mapping"] if node.op.name == "rename" else {}
    made_from = [old for old, new in mapping.items() if new == dim]
    if made_from:   # the dim the rename makes, its parts the written dim's
        return _window_keys_only(g, dim, made_from[0])
    return (dim in mapping and any(dim in t.shape.names for t in g.params)
            and not g.mixes(dim, mapping[dim]))


def _window_keys(g: _Graph, dim: str, src: str) -> bool:
    """Whether a sliding-window attention reads ``dim`` (renamed from ``src``) as its keys against
    ``src`` as its queries: the keys keep ``src``'s split (a halo each) though a global attention
    meets the two too (Gemma 3's local and global layers: it gathers its keys at the attention,
    as the rename would have, and the local layers no longer gather theirs)."""
    return any(n.op.name == "attention" and n.attrs.get("window") is not None
               and (n.attrs["key_dim"], n.attrs["query_dim"]) == (dim, src) for n in g.forward)


def _window_keys_only(g: _Graph, dim: str, src: str) -> bool:
    """Whether the only forward ops that mix ``dim`` (renamed from ``src``) are sliding-window
    attentions with ``dim`` their keys and ``src`` their queries: each rank then reads its own
    keys and a halo of its neighbours' (:mod:`.attention`), for equal blocks or not, so the
    keys may take the queries' uneven split (seq 11 over ``model:3``: blocks 4, 4, 3 both)."""
    found = False
    for n in g.forward:
        if n.op.subgraphs(n) or not any(dim in t.shape.names for t in n.inputs):
            continue
        if n.op.name == "attention" and n.attrs.get("window") is not None \
                and (n.attrs["key_dim"], n.attrs["query_dim"]) == (dim, src):
            found = True
        elif n.op.name == "rename" or dim in n.op.spec(n).fixed or dim in n.op.spec(n).reduce:
            return False   # (another op mixes the keys: an uneven split measured dearer)
    return found


def _votes(g: _Graph, mesh, layout: Layout) -> dict[tuple, int]:
    """The elements of the forward reshapes that carry the written layout's split to each
    ``(dim, axes)`` they make: what an implied rule ``dim:axes`` keeps split (those reshapes move
    nothing; under a rival's rule they would move each of those elements)."""
    out: dict[tuple, int] = {}
    for node in g.movers:
        if node.op.name in RESHAPES:
            for dim, axes, _ in _carried(node, mesh, layout, {}, g):
                out[dim, tuple(axes)] = out.get((dim, tuple(axes)), 0) + node.outputs[0].shape.numel
    return out


def _outvoted(node, dim: str, axes, votes: dict, g: _Graph, mesh, layout: Layout, strict: bool):
    """The dim that should take ``axes`` instead of ``dim`` (which ``node`` would carry them to),
    or None: one that an op holds with ``dim`` (the two contend for the axes) but ``node``'s input
    does not (a chain of reshapes passes the split on), whose reshapes keep more elements split, and that is refused
    only for a size no leaf has (a slice or concat of it: a size-1 part is whole, others split
    unevenly, which strict splits refuse).

    BigBird cuts ``seq`` into ``(blk pos)`` blocks for its queries, keys and values, and once
    for the global block alone (``blk`` 1, so ``pos`` takes ``seq``'s split there); ``blk`` also
    has size 5 (the sparse blocks sliced off the global one).  Under ``seq:model``, ``pos:model``
    from the one-block reshape made every block reshape alltoall; ``blk:model`` keeps them split.
    """
    if strict:
        return None
    best, most, mine = None, votes.get((dim, tuple(axes)), 0), node.inputs[0].shape.names
    for (other, on), n in votes.items():
        if on != tuple(axes) or other in (dim, *mine) or n <= most or not g.meet(dim, other) or other in g.scanned:
            continue   # (a dim a repeat scans stays whole: implied_layout)
        if _fits_unevenly(other, axes, g, mesh, layout):
            best, most = other, n
    return best


def _fits_unevenly(dim: str, axes, g: _Graph, mesh, layout: Layout) -> bool:
    """Whether ``dim:axes`` fits where sizes no leaf has may be split unevenly or, at size 1
    (or below the axes), kept whole (:meth:`Layout.targets` does both for an intermediate).
    Not where a reshape makes ``dim`` at a size the axes leave uneven (TimesNet's two folds of
    ``time`` 120 into ``cycles`` 20 and 15): a reshape carries no uneven split, so that fold
    would gather its input, and the rule would take the axes from the dim that keeps them (the
    unfold's ``cycles_period``) for the even fold too."""
    n = mesh.axis_size(axes)
    leaf_sizes = {d.size for t in g.leaves for d in t.shape if d.name == dim}
    made = {d.size for m in g.movers if m.op.name in RESHAPES for d in m.outputs[0].shape if d.name == dim}
    if any(size % n for size in leaf_sizes) or any(size % n and size >= n for size in made):
        return False
    for t in g.leaves:
        if dim in t.shape.names and layout.rule_for(dim, t.scopes) is None:
            if any(o != dim and set(r.axis_names) & set(axes) for o, r in layout.wanted(t.shape, t.scopes).items()):
                return False
    return True


def _fits(dim: str, axes, g: _Graph, mesh, layout: Layout, uneven_ok: bool = False) -> bool:
    """Whether ``dim:axes`` divides every size ``dim`` has (with ``uneven_ok``: leaves no part
    empty) and leaves each param and input with every axis on one dim at most."""
    n = mesh.axis_size(axes)
    if any(size < n if uneven_ok else size % n for size in g.sizes.get(dim, ())):
        return False
    for t in g.leaves:
        if dim not in t.shape.names or layout.rule_for(dim, t.scopes) is not None:
            continue   # (a written scoped rule places that tensor's dim)
        for other, r in layout.wanted(t.shape, t.scopes).items():
            if other != dim and set(r.axis_names) & set(axes):
                return False
    return True
