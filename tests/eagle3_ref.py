"""A tiny Llama target and a tiny EAGLE-3 draft checkpoint in the public format
(SGLang's ``LlamaForCausalLMEagle3`` names), and a plain-torch EAGLE-3 reference written
from the published definition: ``fc`` over the target's concatenated hidden states, one
decoder layer whose q/k/v read ``[input_layernorm(embed(ids)), hidden_norm(fc(h))]``, the
residual from ``fc``'s output, ``norm`` and an LM head over the draft vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from cp_utils import write_tiny_llama

TARGET = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0)
DRAFT_VOCAB = 128
DRAFT_INTERMEDIATE = 96
#: the target layers feeding fc, out of order (the concatenation follows this order)
LAYER_IDS = (2, 0, 1)


def write_target(folder: Path, seed: int = 0) -> Path:
    """The target: a tiny 4-layer Llama without RoPE scaling."""
    return write_tiny_llama(folder, seed, **TARGET, rope_scaling=None)


def draft_config(**overrides) -> dict:
    d = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=64,
             intermediate_size=DRAFT_INTERMEDIATE, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
             vocab_size=512, draft_vocab_size=DRAFT_VOCAB, max_position_embeddings=4096, rms_norm_eps=1e-6,
             rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32", hidden_act="silu",
             eagle_config={"eagle_aux_hidden_state_layer_ids": list(LAYER_IDS)})
    d.update(overrides)
    return {k: v for k, v in d.items() if v is not None}


def draft_tensors(seed: int = 1, head_dim: int = 16) -> dict[str, torch.Tensor]:
    """Seeded weights under the checkpoint's names (norms away from 1 so they matter);
    4 heads and 2 KV heads of ``head_dim``."""
    g = torch.Generator().manual_seed(seed)
    h, i, q, kv = 64, DRAFT_INTERMEDIATE, 4 * head_dim, 2 * head_dim

    def w(*shape, scale=0.1):
        return scale * torch.randn(*shape, generator=g)

    m = "midlayer."
    t = {"fc.weight": w(h, 3 * h), m + "self_attn.q_proj.weight": w(q, 2 * h), m + "self_attn.k_proj.weight": w(kv, 2 * h),
         m + "self_attn.v_proj.weight": w(kv, 2 * h), m + "self_attn.o_proj.weight": w(h, q),
         m + "mlp.gate_proj.weight": w(i, h), m + "mlp.up_proj.weight": w(i, h), m + "mlp.down_proj.weight": w(h, i),
         "lm_head.weight": w(DRAFT_VOCAB, h)}
    for n in (m + "input_layernorm.weight", m + "hidden_norm.weight", m + "post_attention_layernorm.weight",
              "norm.weight"):
        t[n] = 1.0 + w(h)
    ids = np.sort(np.random.default_rng(seed).choice(512, DRAFT_VOCAB, replace=False))
    t["d2t"] = torch.from_numpy(ids - np.arange(DRAFT_VOCAB)).to(torch.int64)
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[torch.from_numpy(ids)] = True
    t["t2d"] = t2d
    return t


def write_draft(folder: Path, tensors: dict | None = None, config: dict | None = None) -> Path:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or draft_config()))
    save_file({k: v.contiguous() for k, v in (tensors or draft_tensors()).items()}, str(folder / "model.safetensors"))
    return folder


# ---- the reference ------------------------------------------------------------------
def _rms(x, w, eps=1e-6):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    f = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    xf = x.float()
    rot = torch.cat([-xf[..., d // 2:], xf[..., :d // 2]], -1)
    return (xf * cos + rot * sin).to(x.dtype)


def eagle3_reference(w: dict, embed: torch.Tensor, hidden3: torch.Tensor, ids: torch.Tensor, start: int = 0,
                     past: tuple | None = None):
    """Draft rows at positions ``start ..`` (``ids``: their shifted input ids; ``hidden3``:
    [rows, 3H] the target's states; ``past``: earlier positions' (k, v) after RoPE,
    [T0, KVH, D]); returns float32 logits [rows, draft_vocab], the rows before the final
    norm, and every position's (k, v)."""
    dt = hidden3.dtype
    W = {k: v.to(dt) for k, v in w.items() if v.is_floating_point()}
    m = "midlayer."
    n = ids.shape[0]
    pos = torch.arange(start, start + n)
    x = hidden3 @ W["fc.weight"].t()
    a = torch.cat([_rms(embed[ids].to(dt), W[m + "input_layernorm.weight"]), _rms(x, W[m + "hidden_norm.weight"])], -1)
    q = (a @ W[m + "self_attn.q_proj.weight"].t()).view(n, 4, 16)
    k = (a @ W[m + "self_attn.k_proj.weight"].t()).view(n, 2, 16)
    v = (a @ W[m + "self_attn.v_proj.weight"].t()).view(n, 2, 16)
    q, k = _rope(q, pos), _rope(k, pos)
    if past is not None:
        k, v = torch.cat([past[0], k]), torch.cat([past[1], v])
    T = k.shape[0]
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # GQA: 2 query heads a KV head
    s = torch.einsum("qhd,khd->hqk", q.float(), kk.float()) * 16 ** -0.5
    mask = torch.arange(T)[None, :] > (torch.arange(n) + T - n)[:, None]
    p = torch.softmax(s.masked_fill(mask, float("-inf")), -1)
    o = torch.einsum("hqk,khd->qhd", p, vv.float()).to(dt).reshape(n, 64)
    hres = x + o @ W[m + "self_attn.o_proj.weight"].t()
    y = _rms(hres, W[m + "post_attention_layernorm.weight"])
    pre = hres + (F.silu(y @ W[m + "mlp.gate_proj.weight"].t()) * (y @ W[m + "mlp.up_proj.weight"].t())) \
        @ W[m + "mlp.down_proj.weight"].t()
    return (_rms(pre, W["norm.weight"]) @ W["lm_head.weight"].t()).float(), pre, (k, v)


def target_states(hf, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' target over ``ids``: fc's input [T, 3H] (layer k: hidden_states[k + 1])
    and the logits [T, vocab] float32."""
    with torch.inference_mode():
        out = hf(torch.as_tensor(ids)[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[k + 1][0] for k in LAYER_IDS], -1), out.logits[0].float()


def shifted(ids: np.ndarray, nxt: int) -> torch.Tensor:
    return torch.as_tensor(np.concatenate([ids[1:], [nxt]]), dtype=torch.int64)


def write_moe_target(folder: Path, top_k: int, seed: int = 0) -> Path:
    """A tiny Qwen3-MoE target with the dense target's attention shape (so the draft fits
    both): 8 experts, top ``top_k`` renormalised, layer 1 dense."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**TARGET, head_dim=16, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=top_k,
                         moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # routers far from uniform: few near-ties
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return folder


# ---- a target that counts, and a draft that agrees with it ------------------------------
def write_counting_target(folder: Path, seed: int = 0) -> Path:
    """The target with weights that make its greedy token the one after the current one
    (``t + 1 mod vocab``): its layers' outputs scaled down (they still move every logit, so
    a wrong K/V shows in the logits) and its LM head row ``v`` the embedding of ``v - 1``."""
    from transformers import LlamaForCausalLM

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    src = write_target(folder.parent / f"{folder.name}-random", seed)
    model = LlamaForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(0.05)
        emb = model.model.embed_tokens.weight
        model.lm_head.weight.copy_(torch.roll(emb, 1, dims=0))
    model.save_pretrained(folder)
    return folder


def agreeing_draft_tensors(alpha: float = 2.0) -> dict[str, torch.Tensor]:
    """An EAGLE-3 draft that proposes ``token + 1`` for each input token: what the counting
    target generates. Its attention attends a row to itself (queries and keys are the
    row's normed embedding, dims 0..31) and carries that embedding to the residual, its
    values subtract what the row read (``fc`` gives 0; a proposal after the first reads its
    own previous row, which the values cancel), the MLP adds nothing, and the LM head over
    the full vocabulary picks the embedding's own token, which ``d2t`` moves on by one."""
    h, q, kv = 64, 64, 32
    m = "midlayer."
    z = torch.zeros
    qw, kw, vw, ow = z(q, 2 * h), z(kv, 2 * h), z(kv, 2 * h), z(h, q)
    for head in range(4):  # query head h reads key head h // 2 (GQA): its 16 dims of the embedding
        g = head // 2
        qw[head * 16:(head + 1) * 16, g * 16:(g + 1) * 16] = alpha * torch.eye(16)
    kw[:, :kv] = alpha * torch.eye(kv)
    vw[:, :kv] = torch.eye(kv)
    # the previous row x (dims 0..31 of a normed embedding: rms over 64 dims ~ 1/sqrt(2)) comes back as -x
    vw[:, h:h + kv] = -(0.5 ** 0.5) * torch.eye(kv)
    ow[0:16, 0:16] = torch.eye(16)  # query head 0 (key head 0) -> dims 0..15
    ow[16:32, 32:48] = torch.eye(16)  # query head 2 (key head 1) -> dims 16..31
    t = {"fc.weight": z(h, 3 * h), m + "self_attn.q_proj.weight": qw, m + "self_attn.k_proj.weight": kw,
         m + "self_attn.v_proj.weight": vw, m + "self_attn.o_proj.weight": ow,
         m + "mlp.gate_proj.weight": z(DRAFT_INTERMEDIATE, h), m + "mlp.up_proj.weight": z(DRAFT_INTERMEDIATE, h),
         m + "mlp.down_proj.weight": z(h, DRAFT_INTERMEDIATE)}
    for n in (m + "input_layernorm.weight", m + "hidden_norm.weight", m + "post_attention_layernorm.weight",
              "norm.weight"):
        t[n] = torch.ones(h)
    return t


def write_agreeing_draft(folder: Path, target: Path, swap: bool = False) -> Path:
    """:func:`agreeing_draft_tensors` with the LM head the target's normed embedding (dims
    0..31) and ``d2t`` one on (the last id back to 0), over the full vocabulary. ``swap``:
    proposals of ``4m`` and ``4m + 1`` swapped (it agrees on half the tokens: runs of
    accepted proposals of every length)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    V = TARGET["vocab_size"]
    emb = load_file(str(Path(target) / "model.safetensors"))["model.embed_tokens.weight"].float()
    normed = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + 1e-6)
    t = agreeing_draft_tensors()
    head = torch.zeros(V, 64)
    head[:, :32] = normed[:, :32]
    t["lm_head.weight"] = head
    to = (torch.arange(V) + 1) % V
    if swap:
        to = torch.where(to % 4 == 0, to + 1, torch.where(to % 4 == 1, to - 1, to))
    d2t = to - torch.arange(V)
    t["d2t"], t["t2d"] = d2t, torch.ones(V, dtype=torch.bool)
    return write_draft(folder, t, draft_config(draft_vocab_size=V))
