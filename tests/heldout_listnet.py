"""Listwise learning to rank (ListNet), written from the README and docs/ alone (a held-out model).

Dims: ``batch`` (queries), ``docs`` (candidate documents per query, padded), ``d_query``,
``d_doc`` (input features), ``d_hidden``. Each query-document pair is scored by a two-layer MLP
over the sum of the query's and the document's projections (so the hidden layer is a matmul
pair, Megatron's split of ``d_hidden``). ``num_docs [batch]`` (fed) says how many documents of
a query are real; padding ones are masked out of both softmaxes over ``docs``. The loss is
ListNet's top-one cross entropy: ``-sum_d softmax(labels)_d * log_softmax(scores)_d`` per query
against graded relevance labels (0..3), averaged over the queries.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 16
    docs: int = 32
    d_query: int = 16
    d_doc: int = 16
    d_hidden: int = 64

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, docs=6, d_query=3, d_doc=5, d_hidden=8)


def build(cfg: Config = Config()) -> md.Model:
    batch, docs = md.Dim("batch", cfg.batch), md.Dim("docs", cfg.docs)
    d_query, d_doc = md.Dim("d_query", cfg.d_query), md.Dim("d_doc", cfg.d_doc)
    d_hidden = md.Dim("d_hidden", cfg.d_hidden)
    with md.Graph("heldout_listnet") as g:
        query = md.input("query", [batch, d_query])
        doc = md.input("doc", [batch, docs, d_doc])
        labels = md.input("labels", [batch, docs])                  # graded relevance, 0..3
        num_docs = md.input("num_docs", [batch], dtype=torch.int64)
        w_q = md.param("w_q", [d_query, d_hidden], fan_out=["d_hidden"])
        w_d = md.param("w_d", [d_doc, d_hidden], fan_out=["d_hidden"])
        b_h = md.param("b_h", [d_hidden], init="zeros")
        w_s = md.param("w_s", [d_hidden])

        h = md.relu(md.einsum("batch d_query, d_query d_hidden -> batch d_hidden", query, w_q)
                    + md.einsum("batch docs d_doc, d_doc d_hidden -> batch docs d_hidden", doc, w_d) + b_h)
        scores = md.einsum("batch docs d_hidden, d_hidden -> batch docs", h, w_s)
        real = md.less(md.arange(docs), num_docs)                      # [docs, batch]
        log_p = md.log_softmax(md.where(real, scores, -1e9), "docs")
        target = md.softmax(md.where(real, labels, -1e9), "docs")      # 0 on padding documents
        listwise = -md.reduce_sum(target * md.where(real, log_p, 0.0), "docs")
        loss = md.reduce_mean(listwise)
        # the top-scored real document's grade, against the best grade of the query
        best = md.reduce_max(md.where(real, scores, -1e9), "docs")
        top_grade = md.reduce_max(md.where(md.logical_and(real, md.greater_equal(scores, best)), labels, -1.0), "docs")
        top1 = md.reduce_mean(md.cast(md.greater_equal(top_grade, md.reduce_max(md.where(real, labels, -1.0), "docs")),
                                      torch.float32))
    params = {"w_q": w_q, "w_d": w_d, "b_h": b_h, "w_s": w_s}

    def batches(seed: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
        """Grades from a hidden bilinear relevance of query and document, quantised to 0..3."""
        idx = range(cfg.batch)[rows or slice(None)]
        hidden = torch.randn(cfg.d_query, cfg.d_doc, generator=torch.Generator().manual_seed(1234))
        qs, ds, ls, ns = [], [], [], []
        for r in idx:
            gen = md.row_generator(seed, r)
            q, d = torch.randn(cfg.d_query, generator=gen), torch.randn(cfg.docs, cfg.d_doc, generator=gen)
            n = int(torch.randint(2, cfg.docs + 1, (), generator=gen))
            grade = torch.bucketize(d @ (q @ hidden), torch.tensor([-1.0, 0.0, 1.0])).float()
            d[n:] = 0.0
            grade[n:] = 0.0
            qs.append(q), ds.append(d), ls.append(grade), ns.append(n)
        if not qs:
            return {"query": torch.zeros(0, cfg.d_query), "doc": torch.zeros(0, cfg.docs, cfg.d_doc),
                    "labels": torch.zeros(0, cfg.docs), "num_docs": torch.zeros(0, dtype=torch.int64)}
        return {"query": torch.stack(qs), "doc": torch.stack(ds), "labels": torch.stack(ls),
                "num_docs": torch.tensor(ns, dtype=torch.int64)}

    return md.Model(g, loss, params, batches=batches, config=cfg, metrics={"top1": top1},
                    outputs={"scores": scores})
