"""Fused scaled dot-product attention: one torch kernel forward, one backward.

``attention(q, k, v, ...)`` is ``softmax(q . k * scale, masked) . v`` over named
dims, the math of the composite ``einsum -> mul -> where(causal_mask) -> softmax
-> einsum``, run as torch's fused CPU attention kernel (the flash-attention
form behind ``F.scaled_dot_product_attention``): no [.., seq, key_seq] score
tensor is written, q, k and v are read in their own layouts (no permuted copy),
and the output comes out in q's dim order.  The forward also returns the
row-wise logsumexp, which the backward kernel reads instead of the scores.

Lowering: batch and head dims may be split and stay local.  The forward may
split the query dim too (each rank passes its slice's causal mask, offset by
``ctx``); the backward keeps it whole, since dk and dv sum over every query.
The key and feature dims are whole on a rank, except under a ``window``: a query dim and key dim
split alike take each rank's key block extended by its neighbours' halo rows
(:mod:`meshdsl.lowering.attention`; the mask is offset by ``attrs["halo"]``, see :func:`_mask`),
and with attention ``sinks`` the first keys, from the ranks that hold them, before that block.

On a GPU the forward and backward run CUDA's memory-efficient attention kernels (fp32,
a feature size they take, no offset mask); elsewhere, or with
``MESHDSL_ATTENTION=math``, the same contract (out and logsumexp forward; dq, dk, dv
backward) is computed in the unfused math form (:func:`math_forward`,
:func:`math_backward`), which writes each head's score tensor.
"""
from __future__ import annotations

import math

import torch

from ..core.graph import Tensor
from ..core.shape import Dim, Shape
from ..errors import GraphError, ShapeError, env_choice, message
from .registry import ComputeSpec, Op, apply, register

# (the overloads themselves: no overload to pick per call)
_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _scale(q4, scale) -> float:
    """The score scale: ``scale``, or 1/sqrt(feature size) as the fused kernels default to."""
    return q4.shape[-1] ** -0.5 if scale is None else scale


def _scores(q4, k4, causal: bool, mask, scale):
    """The masked scores ``q . k * scale`` in at least float32 (the fused kernel's
    accumulation): one [.., seq, key_seq] buffer, written by the product, masked in place."""
    acc = torch.promote_types(q4.dtype, torch.float32)
    s = (q4.to(acc) * _scale(q4, scale)) @ k4.to(acc).transpose(-2, -1)   # the scale on q: the smaller operand
    if causal:
        n_q, n_k = s.shape[-2:]
        s.masked_fill_(torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if mask is not None:
        s.add_(mask)
    return s


def math_forward(q4, k4, v4, causal: bool, mask, scale):
    """(out, logsumexp) of attention over [batch, heads, seq, feature] tensors: what the fused
    CPU kernel returns, in plain tensor ops (any device)."""
    s = _scores(q4, k4, causal, mask, scale)
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ v4.to(s.dtype)
    return out.to(q4.dtype), lse


def math_backward(g4, q4, k4, v4, out4, lse4, causal: bool, mask, scale):
    """(dq, dk, dv) from the forward's out (the probabilities are recomputed from q and k; the
    logsumexp is the forward's, unused here)."""
    p = torch.softmax(_scores(q4, k4, causal, mask, scale), -1)
    g = g4.to(p.dtype)
    dv = p.transpose(-2, -1) @ g
    ds = (g @ v4.to(p.dtype).transpose(-2, -1)).sub_((g * out4.to(p.dtype)).sum(-1, keepdim=True)).mul_(p)
    c = _scale(q4, scale)
    dq = (ds @ k4.to(p.dtype)).mul_(c)
    dk = (ds.transpose(-2, -1) @ q4.to(p.dtype)).mul_(c)
    return dq.to(q4.dtype), dk.to(k4.dtype), dv.to(v4.dtype)


#: $MESHDSL_ATTENTION: "fused" (default): torch's fused kernels (the CPU flash kernel; CUDA's
#: memory-efficient one where it takes the shape and dtype); "math": the unfused form off the CPU.
ENV, MODES = "MESHDSL_ATTENTION", ("fused", "math")
#: feature size -> whether CUDA's memory-efficient kernel took it in fp32 (tried once)
_CUDA_FUSED: dict = {}
_LSE_ALIGN = 32   # the memory-efficient kernel pads its logsumexp rows to a multiple of this


def attention_mode() -> str:
    """``$MESHDSL_ATTENTION``, checked: ``fused`` (the default) or ``math``."""
    return env_choice(ENV, MODES, "an attention form", "set it to math for the unfused form", GraphError)


def _cuda_fused(q4, mask) -> bool:
    # fp32 only: on an H200 (torch 2.11) the bf16 backward of this kernel, called as here,
    # disagreed with the CPU kernel and the math form far beyond bf16 rounding.
    return attention_mode() == "fused" and mask is None and q4.device.type == "cuda" and q4.dtype == torch.float32 \
        and _CUDA_FUSED.get(q4.shape[-1], True)


def _forward(q4, k4, v4, causal: bool, mask, scale):
    if q4.device.type == "cpu":  # the CPU kernel takes fewer key/value heads than query heads
        return _FWD(q4, k4, v4, 0.0, causal, attn_mask=mask, scale=scale)
    k4, v4 = _expand_kv(k4, q4), _expand_kv(v4, q4)
    if _cuda_fused(q4, mask):
        key = q4.shape[-1]
        try:
            out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
                q4, k4, v4, None, True, 0.0, causal, scale=scale)
            _CUDA_FUSED[key] = True
            return out, lse[..., :q4.shape[-2]]
        except RuntimeError:   # a shape or dtype the kernel does not take: the math form, from now on
            _CUDA_FUSED[key] = False
    return math_forward(q4, k4, v4, causal, mask, scale)


def _backward(g4, q4, k4, v4, out4, lse4, causal: bool, mask, scale):
    if q4.device.type == "cpu":
        return _BWD(g4, q4, k4, v4, out4, lse4, 0.0, causal, attn_mask=mask, scale=scale)
    dq, dk, dv = _backward_expanded(g4, q4, _expand_kv(k4, q4), _expand_kv(v4, q4), out4, lse4, causal, mask, scale)
    return dq, _sum_groups(dk, k4), _sum_groups(dv, v4)


def _backward_expanded(g4, q4, k4, v4, out4, lse4, causal: bool, mask, scale):
    if _cuda_fused(q4, mask) and _CUDA_FUSED.get(q4.shape[-1]):
        pad = (-lse4.shape[-1]) % _LSE_ALIGN
        lse = torch.nn.functional.pad(lse4, (0, pad)) if pad else lse4
        none = torch.empty((), dtype=torch.int64, device=q4.device)   # no dropout: no random state
        try:
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                g4.contiguous(), q4, k4, v4, None, out4.contiguous(), lse.contiguous(), none, none, 0.0,
                [True, True, True, False], causal, scale=scale)
            return dq, dk, dv
        except RuntimeError:   # the math backward needs only out (it recomputes the probabilities)
            _CUDA_FUSED[q4.shape[-1]] = False
    return math_backward(g4, q4, k4, v4, out4, lse4, causal, mask, scale)


def _layout(attrs: dict, q: Tensor, k: Tensor, v: Tensor) -> None:
    """Fill ``attrs`` with the permutations to and from the kernel's [batch, heads, seq, feature] form.

    ``batch`` lists q's batch dims, those k and v share first, then the ones they lack
    (grouped-query attention's ``group``): folded last into the kernel's heads, so that q's
    head ``n * G + g`` reads k's head ``n``, the grouping torch's kernels take."""
    qd, kd, fd = attrs["query_dim"], attrs["key_dim"], attrs["feature_dim"]
    shared = [n for n in q.shape.names if n not in (qd, fd) and n in k.shape]
    batch = shared + [n for n in q.shape.names if n not in (qd, fd) and n not in k.shape]
    attrs["batch"], attrs["shared"] = tuple(batch), len(shared)
    attrs["q_perm"] = tuple(q.shape.index(n) for n in (*batch, qd, fd))
    attrs["k_perm"] = tuple(k.shape.index(n) for n in (*shared, kd, fd))
    attrs["q_back"] = tuple(attrs["q_perm"].index(i) for i in range(len(q.shape)))
    attrs["k_back"] = tuple(attrs["k_perm"].index(i) for i in range(len(k.shape)))
    # v shares k's dims but may list them in another order.
    attrs["v_perm"] = tuple(v.shape.index(n) for n in (*shared, kd, fd))
    attrs["v_back"] = tuple(attrs["v_perm"].index(i) for i in range(len(v.shape)))


def _to4(x: torch.Tensor, perm, nb: int, lead: int) -> torch.Tensor:
    """``x`` permuted to (batch..., seq, feature) and folded to the kernel's 4 dims: its first
    ``lead`` batch dims into the kernel's batch, the other ``nb - lead`` into its heads."""
    x = x.permute(perm)
    if x.stride(-1) != 1:  # the kernel reads each row of features as one contiguous run
        x = x.contiguous()
    if nb == 2 and lead == 1:
        return x
    s = x.shape  # a reshape folds the batch dims (a copy if they do not merge)
    return x.reshape(math.prod(s[:lead]), math.prod(s[lead:nb]), *s[nb:])


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its last dim contiguous (the kernel reads each row of features as one run)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _q4(x, attrs):
    """q (or a tensor of q's dims in q's order: the output, its gradient) in the kernel's form."""
    return _to4(x, attrs["q_perm"], len(attrs["batch"]), max(attrs["shared"] - 1, 0))


def _kv4(x, attrs, perm):
    """k or v in the kernel's form: heads are their last shared batch dim."""
    return _to4(x, perm, attrs["shared"], max(attrs["shared"] - 1, 0))


def _expand_kv(k4, q4):
    """k4 repeated over each key/value head's group, for kernels that take equal head counts."""
    return k4 if k4.shape[1] == q4.shape[1] else k4.repeat_interleave(q4.shape[1] // k4.shape[1], dim=1)


def _sum_groups(dk4, k4):
    """The gradient of :func:`_expand_kv`: each group's heads summed into their key/value head."""
    if dk4.shape[1] == k4.shape[1]:
        return dk4
    return dk4.unflatten(1, (k4.shape[1], dk4.shape[1] // k4.shape[1])).sum(2)


def _from4(x4: torch.Tensor, batch_sizes, back) -> torch.Tensor:
    if len(batch_sizes) == 2 and x4.shape[0] == batch_sizes[0]:   # _to4 folded nothing: no reshape
        return x4.permute(back)
    return x4.reshape(*batch_sizes, *x4.shape[-2:]).permute(back)


def _near(d, attrs):
    """Whether the key at distance ``d = i - j`` lies in the window (True without one)."""
    window = attrs.get("window")
    if window is None:
        return torch.ones_like(d, dtype=torch.bool)
    return (d if attrs["causal"] else d.abs()) < window


def _mask(ctx, attrs, n_q: int, n_k: int, like: torch.Tensor):
    """(is_causal, additive mask) for this rank's query slice against its keys: the kernel's own
    causal mask when both start at position 0 and no window bounds them, else an explicit one.

    Query ``i`` keeps key ``j`` when ``j <= i`` (``causal``) and, with a ``window`` w,
    ``i - j < w`` (causal: the w keys ending at the query, itself included, as Mistral's
    ``sliding_window``) or ``|i - j| < w`` (not causal: w - 1 keys on each side), or, with
    ``sinks`` S, ``j < S`` (StreamingLLM's attention sinks: the first S keys stay visible).  The keys
    may be a halo-extended block (``attrs["halo"]`` rows before this rank's own, from
    :mod:`meshdsl.lowering.attention`): rows outside ``[0, attrs["keys"])`` are masked; there the
    first ``attrs["sink_rows"]`` keys are copies of keys ``0 .. S - 1`` (kept where the window
    does not reach them) and the block's keys follow (kept by the window alone, so that no key
    counts twice and the halo's unread fill rows are never sinks)."""
    window, sinks, copies = attrs.get("window"), attrs.get("sinks", 0), attrs.get("sink_rows", 0)
    if not attrs["causal"] and window is None:
        return False, None
    q_off = ctx.offset(attrs["query_dim"])
    k_off = ctx.offset(attrs.get("key_dim", "")) - attrs.get("halo", 0)
    if window is None and q_off == 0 == k_off:
        return True, None
    dev = like.device
    i = torch.arange(q_off, q_off + n_q, device=dev)[:, None]
    j = torch.arange(k_off, k_off + n_k - copies, device=dev)
    d = i - j[None, :]
    keep = (d >= 0) if attrs["causal"] else torch.ones_like(d, dtype=torch.bool)
    # out of place: an in-place `&=` (aten::__iand__) stops torch.compile tracing the whole step
    near = _near(d, attrs)
    keep = keep & ((near | (j < sinks)[None, :]) if sinks and not copies else near)
    if "keys" in attrs:
        keep = keep & ((j >= 0) & (j < attrs["keys"]))[None, :]
    if copies:
        ds = i - torch.arange(copies, device=dev)[None, :]
        far = ~_near(ds, attrs)
        keep = torch.cat([far & (ds >= 0) if attrs["causal"] else far, keep], 1)
    return False, torch.zeros(n_q, n_k, dtype=like.dtype, device=dev).masked_fill_(~keep, float("-inf"))


def _mask_perm(attrs: dict, mask: Tensor) -> tuple:
    """Where each of the kernel's (batch..., query, key) dims sits in the user's ``mask``, None
    for a dim it lacks (broadcast)."""
    order = (*attrs["batch"], attrs["query_dim"], attrs["key_dim"])
    return tuple(mask.shape.index(n) if n in mask.shape else None for n in order)


def _with_user_mask(causal_mask, keep, attrs: dict, q):
    """(is_causal, additive mask) of :func:`_mask` with the user's boolean ``keep`` (this rank's
    slice) added: ``-inf`` where it is False, broadcast over the dims it lacks, in the kernel's
    [batch, heads, query, key] form (``q``: this rank's q, for the batch sizes)."""
    causal, mask = causal_mask
    perm, nb = attrs["mask_perm"], len(attrs["batch"])
    present = [p for p in perm if p is not None]
    full = keep.permute(*present).reshape([1 if p is None else keep.shape[p] for p in perm])
    if not nb == 2 == attrs["shared"]:   # the kernel folds q's batch dims: expand, then fold as q's
        sizes = [q.shape[i] for i in attrs["q_perm"][:nb]]
        full = full.expand(*sizes, -1, -1)
        lead = max(attrs["shared"] - 1, 0)
        full = full.reshape(math.prod(sizes[:lead]), math.prod(sizes[lead:]), *full.shape[nb:])
    add = torch.zeros(full.shape, dtype=q.dtype, device=q.device).masked_fill_(~full, float("-inf"))
    return causal, add if mask is None else add + mask


def _spec(attrs: dict, q: Tensor, k: Tensor, backward: bool = False) -> ComputeSpec:
    dims = {d.name: d.size for d in q.shape}
    dims[attrs["key_dim"]] = k.shape.get(attrs["key_dim"]).size
    fixed = {attrs["key_dim"], attrs["feature_dim"]}
    # dk and dv sum over every query, and over the query heads of their group: a split query
    # or group dim leaves them partial sums over its axes (reduced, or reduce-scattered, where
    # they are read); dq keeps those dims, split.
    groups = attrs["batch"][attrs["shared"]:]
    reduce = {n: "sum" for n in (attrs["query_dim"], *groups)} if backward else {}
    return ComputeSpec(dims, fixed=frozenset(fixed), reduce=reduce)


def _flops(attrs: dict, q: Tensor, k: Tensor, local: dict) -> int:
    # Two matmuls of [.., query, feature] x [.., key, feature], 2 FLOPs per term each.
    return 4 * math.prod(local.get(n, s) for n, s in _spec(attrs, q, k).dims.items())


@register
class Attention(Op):
    """(q, k, v) -> (out, logsumexp); attrs: query/key/feature dim names, ``causal``, ``scale``, and
    ``window`` and ``sinks`` when given (the halo lowering adds ``halo``, ``keys`` and
    ``sink_rows``: see :func:`_mask`)."""

    name = "attention"

    def infer(self, inputs, attrs):
        q, k, v = inputs[:3]
        _layout(attrs, q, k, v)
        if len(inputs) == 4:   # the user's mask: its dims in the kernel's (batch..., query, key) order
            attrs["mask_perm"] = _mask_perm(attrs, inputs[3])
        lse = Shape([q.shape.get(n) for n in attrs["batch"]] + [q.shape.get(attrs["query_dim"])])
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return [(q.shape, q.dtype), (lse, lse_dtype)]

    def compute(self, ctx, attrs, q, k, v, keep=None):
        if attrs["shared"] == 2 == len(attrs["batch"]) and q.device.type == "cpu":
            # [batch, heads, seq, feature] by one permute each (the usual case): no folds, no reshapes
            # (dims as separate arguments: torch parses them faster than a tuple)
            q4, k4, v4 = _rows(q.permute(*attrs["q_perm"])), _rows(k.permute(*attrs["k_perm"])), \
                _rows(v.permute(*attrs["v_perm"]))
            causal, mask = _mask(ctx, attrs, q4.shape[-2], k4.shape[-2], q)
            if keep is not None:   # the user's mask (none in the usual call: one check)
                causal, mask = _with_user_mask((causal, mask), keep, attrs, q)
            out4, lse4 = _FWD(q4, k4, v4, 0.0, causal, attn_mask=mask, scale=attrs["scale"])
            return out4.permute(*attrs["q_back"]), lse4
        q4, k4, v4 = _q4(q, attrs), _kv4(k, attrs, attrs["k_perm"]), _kv4(v, attrs, attrs["v_perm"])
        causal, mask = _mask(ctx, attrs, q4.shape[-2], k4.shape[-2], q)
        if keep is not None:   # the user's mask (none in the usual call: one check)
            causal, mask = _with_user_mask((causal, mask), keep, attrs, q)
        out4, lse4 = _forward(q4, k4, v4, causal, mask, attrs["scale"])
        bs = [q.shape[i] for i in attrs["q_perm"][:len(attrs["batch"])]]
        lse = lse4 if lse4.dim() == len(bs) + 1 and lse4.shape[0] == bs[0] else lse4.reshape(*bs, lse4.shape[-1])
        return _from4(out4, bs, attrs["q_back"]), lse

    def spec(self, node):
        return _spec(node.attrs, *node.inputs[:2])

    def flops(self, node, local):
        return _flops(node.attrs, *node.inputs[:2], local)

    def grad(self, node, douts):
        g, g_lse = douts
        if g_lse is not None:
            raise ShapeError("attention: the logsumexp output is for the backward kernel only; it has no gradient")
        masked = len(node.inputs) == 4
        if g is None:
            return [None] * len(node.inputs)
        q = node.inputs[0]
        if g.shape.names != q.shape.names:
            from .shape_ops import transpose
            g = transpose(g, q.shape.names)
        outs = apply("attention_backward", [g, *node.inputs[:3], *node.outputs, *node.inputs[3:]], dict(node.attrs))
        return list(outs) + ([None] if masked else [])   # the mask is boolean: no gradient


@register
class AttentionBackward(Op):
    """(d_out, q, k, v, out, logsumexp) -> (dq, dk, dv): the fused kernel's backward."""

    name = "attention_backward"
    differentiable = False

    def infer(self, inputs, attrs):
        _, q, k, v = inputs[:4]
        return [(q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype)]

    def compute(self, ctx, attrs, g, q, k, v, out, lse, keep=None):
        if attrs["shared"] == 2 == len(attrs["batch"]) and q.device.type == "cpu":   # as Attention.compute
            qp = attrs["q_perm"]
            q4, k4, v4 = _rows(q.permute(*qp)), _rows(k.permute(*attrs["k_perm"])), _rows(v.permute(*attrs["v_perm"]))
            causal, mask = _mask(ctx, attrs, q4.shape[-2], k4.shape[-2], q)
            if keep is not None:   # the user's mask (none in the usual call: one check)
                causal, mask = _with_user_mask((causal, mask), keep, attrs, q)
            lse4 = lse if lse.shape == q4.shape[:-1] else lse.reshape(q4.shape[:-1])
            dq, dk, dv = _BWD(_rows(g.permute(*qp)), q4, k4, v4, _rows(out.permute(*qp)), lse4, 0.0, causal,
                              attn_mask=mask, scale=attrs["scale"])
            return dq.permute(*attrs["q_back"]), dk.permute(*attrs["k_back"]), dv.permute(*attrs["v_back"])
        q4, k4, v4 = _q4(q, attrs), _kv4(k, attrs, attrs["k_perm"]), _kv4(v, attrs, attrs["v_perm"])
        causal, mask = _mask(ctx, attrs, q4.shape[-2], k4.shape[-2], q)
        if keep is not None:   # the user's mask (none in the usual call: one check)
            causal, mask = _with_user_mask((causal, mask), keep, attrs, q)
        lse4 = lse if lse.shape == q4.shape[:-1] else lse.reshape(q4.shape[:-1])
        dq, dk, dv = _backward(_q4(g, attrs), q4, k4, v4, _q4(out, attrs), lse4, causal, mask, attrs["scale"])
        bs = [q.shape[i] for i in attrs["q_perm"][:len(attrs["batch"])]]
        kbs = [k.shape[i] for i in attrs["k_perm"][:attrs["shared"]]]
        return _from4(dq, bs, attrs["q_back"]), _from4(dk, kbs, attrs["k_back"]), _from4(dv, kbs, attrs["v_back"])

    def spec(self, node):
        return _spec(node.attrs, *node.inputs[1:3], backward=True)

    def flops(self, node, local):
        return 2 * _flops(node.attrs, *node.inputs[1:3], local)


def _check_options(causal, scale, window) -> None:
    if not isinstance(causal, bool) or (scale is not None and (isinstance(scale, bool)
                                                               or not isinstance(scale, (int, float)))):
        bad = (f"causal={causal!r} ({type(causal).__name__}) is not True or False" if not isinstance(causal, bool)
               else f"scale={scale!r} ({type(scale).__name__}) is not a number")
        raise ShapeError(message(f"attention: {bad}.",
                                 rule="causal is True or False; scale is None (1/sqrt of the feature size) or a number",
                                 fix="pass e.g. causal=False, scale=0.125"))
    if window is None or (isinstance(window, int) and not isinstance(window, bool) and window >= 1):
        return
    what = "is not positive" if isinstance(window, int) and not isinstance(window, bool) else \
        f"({type(window).__name__}) is not an int"
    raise ShapeError(message(
        f"attention: window={window!r} {what}.",
        rule="window is None (no window) or an int w >= 1: a causal query i attends to the keys "
             "i - w < j <= i, itself included (w=1: itself only)",
        fix="pass e.g. window=4096 (Mistral's sliding_window), or leave it out"))


def _check_operands(q: Tensor, k: Tensor, v: Tensor, qd: str, kd: str, fd: str) -> None:
    """Refuse q, k, v whose dims, sizes or dtypes do not line up (see :func:`attention`)."""
    batch = [n for n in q.shape.names if n not in (qd, fd)]
    kv = [n for n in batch if n in k.shape]   # the batch dims k shares; the others are broadcast
    want = {"q": (q, [*batch, qd, fd]), "k": (k, [*kv, kd, fd]), "v": (v, [*kv, kd, fd])}
    bullets = [f"{name} {x.shape} should have the dims {sorted(dims)}" for name, (x, dims) in want.items()
               if sorted(x.shape.names) != sorted(dims)]
    if not bullets:
        bullets = [f"dim '{d.name}' of {name} has size {d.size}, of q {q.shape.get(d.name).size}"
                   for name, x in (("k", k), ("v", v)) for d in x.shape if d.name in q.shape and d.name != qd
                   and q.shape.get(d.name) != d]
        bullets += [f"v's '{kd}' {v.shape.get(kd).size} differs from k's {k.shape.get(kd).size}"] \
            if v.shape.get(kd) != k.shape.get(kd) else []
    dtypes = {x.dtype for x in (q, k, v)}
    if len(dtypes) > 1 or not q.dtype.is_floating_point:
        bullets.append(f"q, k, v have dtypes {sorted(map(str, dtypes))}; they share one floating dtype")
    if bullets:
        raise ShapeError(message(
            f"attention(q, k, v, query_dim='{qd}', key_dim='{kd}', feature_dim='{fd}'): the operands do not line up.",
            inputs=[f"q: {q.shape}", f"k: {k.shape}", f"v: {v.shape}"], bullets=bullets,
            rule="q is [batch..., query, feature]; k and v are [the same batch... or some of them "
                 "(grouped-query attention), key, feature]",
            fix="rename the dims (meshdsl.rename) so that they match"))


def _check_sinks(sinks, window, k: Tensor, kd: str) -> None:
    """Refuse a ``sinks`` that is not an int in ``[0, keys]``, or that is set without a window."""
    n = k.shape.get(kd).size
    if isinstance(sinks, bool) or not isinstance(sinks, int):
        bad = f"sinks={sinks!r} ({type(sinks).__name__}) is not an int"
    elif sinks < 0:
        bad = f"sinks={sinks} is negative"
    elif sinks and window is None:
        bad = f"sinks={sinks} is given without a window (every key the causal mask allows is visible already)"
    elif sinks > n:
        bad = f"sinks={sinks} exceeds the {n} keys of k's '{kd}'"
    else:
        return
    raise ShapeError(message(
        f"attention: {bad}.",
        inputs=[f"k: {k.shape}", f"window: {window!r}"],
        rule=f"sinks is an int 0 <= S <= the size of '{kd}', with a window w: a causal query i attends to "
             "the keys j <= i with i - j < w or j < S (the window, plus the first S keys: attention sinks)",
        fix="pass e.g. window=4, sinks=4 (StreamingLLM), or sinks=0 for a plain window"))


def attention(q: Tensor, k: Tensor, v: Tensor, query_dim="seq", key_dim="key_seq", feature_dim="d_head",
              causal: bool = True, scale: float | None = None, window: int | None = None,
              sinks: int = 0, mask: Tensor | None = None) -> Tensor:
    """Scaled dot-product attention by dim name, as one fused kernel forward and backward.

    ``out[.., query, feature] = sum_key softmax_key(q . k * scale) v``, where ``q . k``
    sums over ``feature_dim`` and every other dim of ``q`` (batch, heads) is a batch
    dim.  ``k`` and ``v`` have the batch dims of ``q`` or some of them: a dim they lack is
    broadcast, which is grouped-query attention (q ``[batch, seq, kv_heads, group,
    d_head]`` against k, v ``[batch, key_seq, kv_heads, d_head]``: each key/value head
    serves the ``group`` query heads of its own, with no copy of k or v on the CPU kernel).
    With ``causal`` a query attends to the keys at or
    before its own position, the mask of ``causal_mask(query_dim, key_dim)``.  The
    composite ``softmax(where(causal_mask(..), einsum(..) * scale, -1e9)) . v`` gives
    the same values; use it when the probabilities need dropout.  With ``window`` w
    (sliding-window, local attention: Mistral's ``sliding_window``, Gemma 2's local layers) a
    causal query ``i`` attends to the w keys ``i - w < j <= i``, itself included (w=1: only
    itself); not causal, to the keys ``|i - j| < w`` (w - 1 on each side).  With ``sinks`` S
    as well (StreamingLLM's attention sinks) the first S keys stay visible besides the window: a
    causal query ``i`` keeps key ``j`` when ``j <= i`` and (``i - j < w`` or ``j < S``); not
    causal, when ``|i - j| < w`` or ``j < S``.  That is the composite whose mask is
    ``(dist >= 0) & ((dist < w) | (key_pos < S))``, fused.

    Args:
      q: [batch dims..., query_dim, feature_dim] in any dim order.
      k: [q's batch dims or some of them, key_dim, feature_dim], any order.
      v: the dims of ``k``.
      query_dim, key_dim, feature_dim: the dim names (a name or a Dim).
      causal: mask the keys after each query.
      scale: the factor on ``q . k``; default ``1 / sqrt(size of feature_dim)``.
      window: None (every key the mask allows), or a positive int: the keys within ``window``
        positions of the query, itself included (see above).
      sinks: 0 (none), or with a ``window`` the number S of first keys every query may also
        attend to (at most the size of ``key_dim``).
      mask: None, or a boolean tensor, True where a query may attend to a key, over some of q's
        batch dims, ``query_dim`` and ``key_dim`` (broadcast over the dims it lacks): a padding
        mask ``[batch, key_dim]`` (``md.less(md.arange(key_seq), lengths)``), a block-diagonal
        mask ``[query_dim, key_dim]``.  It joins ``causal`` and ``window`` (a key is kept where
        all keep it); every query must keep a key.  It has no gradient.

    Returns:
      The attention output, with ``q``'s dims in ``q``'s order.

    Raises:
      ShapeError: if the dims do not line up as above, or ``window`` / ``sinks`` is out of range.

    Layouts may split the batch dims (``"batch:data; heads:model"``, ``kv_heads:model``)
    with no communication (a split ``group`` leaves the gradients of k and v partial sums);
    a split query dim stays split in the forward and is gathered for the backward; the key
    and feature dims are gathered when split, except a key dim split where the query dim is
    whole and q is smaller than k and v (cross-attention over a long memory): that one stays
    split, lowered as the composite (:mod:`meshdsl.lowering.attention`).  With a ``window``,
    a query dim and key dim split alike (``seq:model``, k and v renamed from ``seq``) stay
    split: each rank receives only the ``window - 1`` key and value rows before its block (and
    after it, not causal) from its neighbours, a halo, and sends their gradients back; with
    ``sinks`` S, the first S key and value rows as well, from the ranks that hold them (one
    allreduce of S rows each), their gradients summed back onto those ranks the same way.
    """
    qd, kd, fd = (d.name if isinstance(d, Dim) else d for d in (query_dim, key_dim, feature_dim))
    bad = next((x for x in (q, k, v) if not isinstance(x, Tensor)), None)
    if bad is not None:
        raise ShapeError(message(f"attention: {bad!r} ({type(bad).__name__}) is not a Tensor.",
                                 rule="attention takes meshdsl Tensors q, k, v", fix="pass Tensors built by ops"))
    _check_options(causal, scale, window)
    _check_operands(q, k, v, qd, kd, fd)
    _check_sinks(sinks, window, k, kd)
    _check_mask(mask, q, k, qd, kd, fd)
    if scale is None:
        scale = q.shape.get(fd).size ** -0.5
    attrs = {"query_dim": qd, "key_dim": kd, "feature_dim": fd, "causal": bool(causal), "scale": float(scale)}
    if window is not None:
        attrs["window"] = window
    if sinks:
        attrs["sinks"] = sinks
    if mask is not None:
        attrs["masked"] = True
    out, _ = apply("attention", [q, k, v] + ([mask] if mask is not None else []), attrs)
    return out


def _check_mask(mask, q: Tensor, k: Tensor, qd: str, kd: str, fd: str) -> None:
    """Refuse a ``mask`` that is not a boolean tensor over q's batch dims, the query and key dims."""
    if mask is None:   # (a mask that is no Tensor is refused with every op's other arguments)
        return
    allowed = {d.name: d.size for d in q.shape if d.name != fd} | {kd: k.shape.get(kd).size}
    bullets = [f"mask is {mask.dtype}, not torch.bool"] if mask.dtype != torch.bool else []
    bullets += [f"mask's dim '{d.name}' is not one of q's batch dims, '{qd}' or '{kd}'" for d in mask.shape
                if d.name not in allowed]
    bullets += [f"mask's '{d.name}' has size {d.size}, not {allowed[d.name]}" for d in mask.shape
                if d.name in allowed and allowed[d.name] != d.size]
    if bullets:
        raise ShapeError(message(
            "attention: the mask does not fit.", bullets=bullets,
            rule=f"mask is a boolean tensor, True where a query may attend to a key, over some of q's batch dims, "
                 f"'{qd}' and '{kd}' (broadcast over the others)",
            fix=f"e.g. a padding mask md.less(md.arange(k.shape['{kd}']), lengths) ([{kd}, batch]), or "
                f"md.cast(m, torch.bool)"))


__all__ = ["attention"]
