"""A SAM-style promptable mask model, written from the README and docs/ alone (a held-out model).

Images ``[img, height, width, rgb]`` are patchified by ``md.rearrange`` and run through a ViT
encoder (pre-norm, non-causal ``md.attention``, gelu MLP) under ``md.repeat`` over ``enc``.
The prompt is a few clicked points ``[img, prompt, uv]``, embedded by a linear map plus a
learned per-prompt embedding; a learned mask token is concatenated first along ``tok``. The
two-way transformer (``md.repeat`` over ``dec``) updates tokens and image together: its carry
is the two concatenated along one ``seq`` dim and sliced apart in each block. Each block:
token self-attention, tokens attend to the image (keys with a learned position embedding),
a token MLP, then the image attends to the tokens. The head upsamples the image embedding
(a linear map to ``(ph pw) chan`` per patch, then a rearrange back to pixels) and takes the
dot product with a hypernetwork of the mask token's output: per-pixel logits ``[img, row,
col]``. The loss: sigmoid binary cross-entropy (written stably with ``md.abs``, ``md.exp`` and
``md.log``) plus a soft dice loss per image, against a fed 0/1 mask.

Legend: i = img, p = patch, t = tok, s = seq (tokens then patches), d = d_model, h = heads.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    imgs: int = 4
    image: int = 32
    patch: int = 4
    d_model: int = 64
    heads: int = 4
    d_head: int = 16
    d_ff: int = 128
    enc_layers: int = 4
    dec_layers: int = 2
    prompts: int = 2
    chan: int = 16
    remat: str = "none"    # md.repeat's remat: none, full, selective

    @classmethod
    def tiny(cls) -> "Config":
        return cls(imgs=4, image=8, patch=2, d_model=8, heads=2, d_head=4, d_ff=12, enc_layers=2,
                   dec_layers=2, prompts=2, chan=3)


def build(cfg: Config = Config()) -> md.Model:
    grid = cfg.image // cfg.patch
    n_patch, n_tok = grid * grid, cfg.prompts + 1
    img, height, width = md.Dim("img", cfg.imgs), md.Dim("height", cfg.image), md.Dim("width", cfg.image)
    rgb, uv, prompt = md.Dim("rgb", 3), md.Dim("uv", 2), md.Dim("prompt", cfg.prompts)
    patch, pix = md.Dim("patch", n_patch), md.Dim("ph_pw_rgb", cfg.patch * cfg.patch * 3)
    d, heads, d_head, d_ff = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    enc, dec, chan = md.Dim("enc", cfg.enc_layers), md.Dim("dec", cfg.dec_layers), md.Dim("chan", cfg.chan)
    up = md.Dim("up", cfg.patch * cfg.patch)
    with md.Graph("heldout_sam") as g:
        image = md.input("image", [img, height, width, rgb])
        points = md.input("points", [img, prompt, uv])
        target = md.input("mask", [img, height, width])
        w_patch = md.param("w_patch", [pix, d], fan_out=[d])
        pos = md.param("pos", [patch, d], scale=0.02)
        w_point = md.param("w_point", [uv, d], fan_out=[d])
        prompt_emb = md.param("prompt_emb", [prompt, d], scale=0.02)
        mask_tok = md.param("mask_tok", [md.Dim("tok", 1), d], scale=0.02)

        def attn_params(L, tag):
            return {f"{tag}_q": md.param(f"{tag}_q", [L, d, heads, d_head], fan_out=[L.name, heads, d_head]),
                    f"{tag}_k": md.param(f"{tag}_k", [L, d, heads, d_head], fan_out=[L.name, heads, d_head]),
                    f"{tag}_v": md.param(f"{tag}_v", [L, d, heads, d_head], fan_out=[L.name, heads, d_head]),
                    f"{tag}_o": md.param(f"{tag}_o", [L, heads, d_head, d], fan_out=[L.name, d])}

        def norms(L, tags):
            return {f"ln_{t}": md.param(f"ln_{t}", [L, d], init="ones") for t in tags}

        enc_p = {**attn_params(enc, "ea"), **norms(enc, ["e1", "e2"]),
                 "e_up": md.param("e_up", [enc, d, d_ff], fan_out=["enc", d_ff]),
                 "e_down": md.param("e_down", [enc, d_ff, d], fan_out=["enc", d])}
        dec_p = {**attn_params(dec, "self"), **attn_params(dec, "t2i"), **attn_params(dec, "i2t"),
                 **norms(dec, ["d1", "d2", "d3", "d4"]),
                 "d_up": md.param("d_up", [dec, d, d_ff], fan_out=["dec", d_ff]),
                 "d_down": md.param("d_down", [dec, d_ff, d], fan_out=["dec", d])}
        w_upscale = md.param("w_upscale", [d, up, chan], fan_out=[up, chan])
        w_hyper = md.param("w_hyper", [d, chan], fan_out=[chan])

        def attend(xq, xk, xv, p, tag, qdim, kdim):
            q = md.einsum(f"img {qdim} d_model, d_model heads d_head -> img {qdim} heads d_head", xq, p[f"{tag}_q"])
            k = md.einsum(f"img {kdim} d_model, d_model heads d_head -> img {kdim} heads d_head", xk, p[f"{tag}_k"])
            v = md.einsum(f"img {kdim} d_model, d_model heads d_head -> img {kdim} heads d_head", xv, p[f"{tag}_v"])
            o = md.attention(q, k, v, qdim, kdim, "d_head", causal=False)
            return md.einsum(f"img {qdim} heads d_head, heads d_head d_model -> img {qdim} d_model", o, p[f"{tag}_o"])

        def mlp(x, w_up, w_down, dims):
            h = md.gelu(md.einsum(f"{dims} d_model, d_model d_ff -> {dims} d_ff", x, w_up))
            return md.einsum(f"{dims} d_ff, d_ff d_model -> {dims} d_model", h, w_down)

        def encoder_block(x, p):
            h = md.layer_norm(x, "d_model", p["ln_e1"])
            x = x + attend(h, md.rename(h, patch="key"), md.rename(h, patch="key"), p, "ea", "patch", "key")
            return x + mlp(md.layer_norm(x, "d_model", p["ln_e2"]), p["e_up"], p["e_down"], "img patch")

        def two_way_block(c, p):
            t = md.slice_(c, "seq", 0, n_tok)
            x = md.rename(md.slice_(c, "seq", n_tok, n_tok + n_patch), seq="patch")
            t = md.rename(t, seq="tok")
            t = md.layer_norm(t + attend(t, md.rename(t, tok="tok2"), md.rename(t, tok="tok2"), p, "self", "tok", "tok2"),
                              "d_model", p["ln_d1"])
            t = md.layer_norm(t + attend(t, x + pos, x, p, "t2i", "tok", "patch"), "d_model", p["ln_d2"])
            t = md.layer_norm(t + mlp(t, p["d_up"], p["d_down"], "img tok"), "d_model", p["ln_d3"])
            x = md.layer_norm(x + attend(x + pos, t, t, p, "i2t", "patch", "tok"), "d_model", p["ln_d4"])
            return md.concat([md.rename(t, tok="seq"), md.rename(x, patch="seq")], "seq")

        patches = md.rearrange(image, "img (gh ph) (gw pw) rgb -> img (gh gw) (ph pw rgb)", ph=cfg.patch, pw=cfg.patch)
        x = md.einsum("img gh_gw ph_pw_rgb, ph_pw_rgb d_model -> img gh_gw d_model", patches, w_patch)
        x = md.rename(x, gh_gw="patch") + pos
        x = md.repeat(encoder_block, x, enc_p, "enc", remat=cfg.remat)

        sparse = md.einsum("img prompt uv, uv d_model -> img prompt d_model", points, w_point) + prompt_emb
        tokens = md.concat([md.broadcast_to(mask_tok, [img, md.Dim("tok", 1), d]), md.rename(sparse, prompt="tok")], "tok")
        carry = md.concat([md.rename(tokens, tok="seq"), md.rename(x, patch="seq")], "seq")
        carry = md.repeat(two_way_block, carry, dec_p, "dec", remat=cfg.remat)
        out_tok = md.squeeze(md.slice_(carry, "seq", 0, 1), "seq")                        # [img, d_model]
        x = md.rename(md.slice_(carry, "seq", n_tok, n_tok + n_patch), seq="patch")

        hyper = md.einsum("img d_model, d_model chan -> img chan", out_tok, w_hyper)
        fine = md.gelu(md.einsum("img patch d_model, d_model up chan -> img patch up chan", x, w_upscale))
        fine = md.rearrange(fine, "img (gh gw) (ph pw) chan -> img (gh ph) (gw pw) chan",
                            gh=grid, ph=cfg.patch)
        logits = md.einsum("img gh_ph gw_pw chan, img chan -> img gh_ph gw_pw", fine, hyper)
        logits = md.rename(logits, gh_ph="height", gw_pw="width")

        bce = md.maximum(logits, 0.0) - logits * target + md.log(1.0 + md.exp(-md.abs(logits)))
        prob = md.sigmoid(logits)
        inter = md.reduce_sum(prob * target, ["height", "width"])
        dice = 1.0 - (2.0 * inter + 1.0) / (md.reduce_sum(prob, ["height", "width"])
                                           + md.reduce_sum(target, ["height", "width"]) + 1.0)
        loss = md.reduce_mean(bce) + md.reduce_mean(dice)

    params = {"w_patch": w_patch, "pos": pos, "w_point": w_point, "prompt_emb": prompt_emb, "mask_tok": mask_tok,
              **enc_p, **dec_p, "w_upscale": w_upscale, "w_hyper": w_hyper}

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        centre = torch.rand(cfg.imgs, 2, generator=gen) * 0.6 + 0.2
        radius = torch.rand(cfg.imgs, 1, 1, generator=gen) * 0.2 + 0.15
        ys = (torch.arange(cfg.image) + 0.5) / cfg.image
        r2 = (ys[None, :, None] - centre[:, 0, None, None]) ** 2 + (ys[None, None, :] - centre[:, 1, None, None]) ** 2
        mask = (r2 < radius ** 2).float()
        image = 0.3 * torch.randn(cfg.imgs, cfg.image, cfg.image, 3, generator=gen) + mask[..., None]
        points = centre[:, None, :] + 0.05 * torch.randn(cfg.imgs, cfg.prompts, 2, generator=gen)
        return {"image": image, "points": points, "mask": mask}

    return md.Model(g, loss, params, feeds, cfg)
