"""Shared fixtures: tiny random Hugging Face checkpoints of every supported family.

``hf_model_dir(family, tied, dtype)`` builds (once per session and argument set) a
2-layer model with transformers' own config class, randomises every weight so that
biases, norms and q/k norms all matter, and saves it with ``save_pretrained``
(safetensors). transformers is imported lazily, inside the factory, so test files
that never build a model do not pay for (or get side effects from) the import.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Triton reads TRITON_INTERPRET when a kernel is defined (at import): set it before any
# test module imports triton, whatever the collection order. A GPU run sets it to 0.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `from helpers import ...`

# one intra-op thread in the test process: the models here are tiny, so an OpenMP team
# costs more than it saves, and its threads spin against the forked ranks (one thread
# each) and anything else on a 2-core runner (transformers' references ran 10-30x slower)
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")  # and in the graphcp commands the tests start



def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked slow: the long combination and acceptance runs (CI runs them)")


def pytest_collection_modifyitems(config, items):
    """The tests marked ``slow`` run only with ``--slow``: the README's command stays within its
    minutes as the suite grows, and CI (``.ci/run``) still runs every one."""
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow (CI does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
#: mixture-of-experts families (hf_config builds them too; 8 experts split over CP 1, 2 and 4)
MOE_FAMILIES = ("qwen3_moe", "mixtral")

#: shared tiny shape: 4 heads / 2 KV heads (GQA), intermediate divisible by 2 and 4
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
)
#: tiny DSA shape (DeepSeek V3.2 / GLM-5): MLA with v_head_dim != qk head dim, 16 indexer
#: heads (a sum of 16 ReLU terms is almost never an exact tie at the k-th best: with few
#: heads many keys score exactly 0 and transformers' top-k picks among them arbitrarily),
#: index_topk 16 (requests past 16 tokens run sparse attention), every layer dense
DSA_TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
    vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-6, q_lora_rank=32, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, index_n_heads=16, index_head_dim=16, index_topk=16,
    first_k_dense_replace=2, rope_theta=10000.0,
)
DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa")
#: tiny DeepSeek V4: a sliding layer (hash MoE), a CSA layer (m = 4, routed MoE) and an HCA
#: layer (m' = 8, hash MoE); a window of 8, 16 indexer heads (fewer make ReLU scores tie at
#: exactly 0), index_topk 3 (rows past position 15 are scored), mHC of 2 streams, YaRN on
#: the compressed branches, 8 experts top-2 (ep splits them over CP 1, 2 and 4)
V4_TINY = dict(
    vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    head_dim=32, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=8, max_position_embeddings=4096,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    mlp_layer_types=["hash_moe", "moe", "hash_moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    hc_mult=2, sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=3,
    partial_rotary_factor=0.5, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
)
#: tiny linear-attention hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): three Gated DeltaNet layers
#: then a full-attention one; 2 key heads of 24 serving 4 value heads of 16, a convolution of 4;
#: the MoE ones 8 experts top-2 and a shared expert (Qwen3-Next's layer 1 dense)
HYBRID_TINY = dict(
    vocab_size=512, hidden_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=24,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=4096, rms_norm_eps=1e-6,
)
HYBRID_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
#: the hybrid families hf_config builds ("qwen3_5": the multimodal checkpoint, a one-block vision tower)
HYBRID_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen3_5")
HYBRID_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=96, patch_size=4,
                     temporal_patch_size=2, num_position_embeddings=16)
#: tiny Kimi Linear (KDA + MLA, Kimi K3's layout): two KDA layers, an MLA layer (no RoPE; its
#: unrotated 8-channel rope slice kept, q_proj without a query latent), a KDA layer; 4 KDA heads
#: of 16, a convolution of 4; layer 0 dense, then DeepSeek's MoE (8 experts top-2 of 2 groups,
#: one group a token, a shared expert); no special tokens (the defaults exceed the vocabulary)
KIMI_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=24, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_local_experts=8, num_experts_per_tok=2, n_group=2,
    topk_group=1, n_shared_experts=1, rms_norm_eps=1e-6, max_position_embeddings=4096, pad_token_id=None,
    bos_token_id=None, eos_token_id=None,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def hf_config(family: str, tied: bool, **overrides):
    """transformers config for one tiny model of ``family``."""
    import transformers

    kw = dict(TINY, tie_word_embeddings=tied)
    if family == "llama":
        # llama3 RoPE scaling, and Llama's attention_bias (q/k/v *and* o_proj) plus mlp_bias
        kw.update(rope_scaling=dict(LLAMA3_ROPE), rope_theta=10000.0, attention_bias=True, mlp_bias=True)
        cls = transformers.LlamaConfig
    elif family == "mistral":
        kw.update(sliding_window=None, rope_theta=10000.0)
        cls = transformers.MistralConfig
    elif family == "qwen2":
        kw.update(rope_theta=10000.0)  # q/k/v bias always on
        cls = transformers.Qwen2Config
    elif family == "qwen3":
        kw.update(head_dim=32, rope_theta=1000000.0)  # explicit head_dim != hidden / heads, q/k norm
        cls = transformers.Qwen3Config
    elif family == "qwen3_moe":
        # top-4 of 8 renormalised; layer 1 dense (mlp_only_layers), so MoE and dense layers alternate
        kw.update(head_dim=32, rope_theta=1000000.0, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
        cls = transformers.Qwen3MoeConfig
    elif family == "mixtral":
        kw.update(sliding_window=None, rope_theta=10000.0, num_local_experts=8, num_experts_per_tok=2)
        cls = transformers.MixtralConfig
    elif family == "deepseek_v4":
        kw = dict(V4_TINY, tie_word_embeddings=tied)
        cls = transformers.DeepseekV4Config
    elif family in DSA_FAMILIES:
        kw = dict(DSA_TINY, tie_word_embeddings=tied)
        cls = transformers.DeepseekV32Config if family == "deepseek_v32" else transformers.GlmMoeDsaConfig
    elif family == "kimi_linear":
        kw = dict(KIMI_TINY, tie_word_embeddings=tied)
        cls = transformers.KimiLinearConfig
    elif family in HYBRID_FAMILIES:
        kw = dict(HYBRID_TINY, tie_word_embeddings=tied)
        if family == "qwen3_5":  # the multimodal config: the text model in text_config
            text = {**kw, **{k: v for k, v in overrides.items()}}
            return transformers.Qwen3_5Config(text_config=text, vision_config=dict(HYBRID_VISION),
                                              tie_word_embeddings=tied)
        if family != "qwen3_5_text":
            kw.update(HYBRID_MOE)
        if family == "qwen3_next":
            kw.update(mlp_only_layers=[1])
        cls = {"qwen3_5_text": transformers.Qwen3_5TextConfig, "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig,
               "qwen3_next": transformers.Qwen3NextConfig}[family]
    else:
        raise ValueError(f"unknown family {family!r}")
    kw.update(overrides)
    return cls(**kw)


def randomise_(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial weights: matrices ~ N(0, 1/fan_in) (attention scores of order 1,
    so attention is far from uniform), norms 1 + N(0, 0.2^2), biases N(0, 0.2^2).
    HF's init leaves biases at zero and norms at one, which would test neither."""
    g = torch.Generator().manual_seed(seed)
    # a hybrid's RMSNorms scale by 1 + weight (zero-centred), but for its gated norm
    centred = getattr(getattr(model, "config", None), "model_type", None) in HYBRID_FAMILIES + ("qwen3_5_moe",)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if p.ndim >= 2:  # matrices, and stacked experts [E, out, in]
                p.copy_(noise * p.shape[-1] ** -0.5)
                if centred and ".in_proj_qkv" in name:  # a hybrid's q/k/v rows (and Qwen3-Next's z): scaled up
                    p.mul_(8.0)  # so that no head's output is near zero (its gated norm would magnify it)
            elif "norm" in name:
                p.copy_((0.0 if centred and "linear_attn" not in name else 1.0) + 0.2 * noise)
            elif name.endswith("A_log"):  # a hybrid's decays: slow (exp(g) near 1), so a state lasts hundreds of tokens
                p.copy_((0.005 + 0.045 * torch.rand(p.shape, generator=g)).log())
            else:  # biases
                p.copy_(0.2 * noise)
        for mod in model.modules():  # a KDA layer's q/k/v rows scaled up (as a hybrid's in_proj_qkv above): the
            if type(mod).__name__.endswith("DeltaAttention"):  # SiLU after the convolution then keeps q and k
                for proj in (mod.q_proj, mod.k_proj, mod.v_proj):  # mostly positive, so no head's q.k cancels
                    proj.weight.mul_(8.0)  # to near zero (the gated norm would magnify its bfloat16 rounding)
        for name, b in model.named_buffers():  # DeepSeek V4's routing tables
            if name.endswith("tid2eid"):  # distinct experts for each token
                experts = model.config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(experts, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=g))


def build_hf_model(family: str, tied: bool, dtype: str = "float32", seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = hf_config(family, tied, **overrides)
    if family == "qwen3_5":  # the multimodal model (AutoModelForCausalLM would build the text model only)
        from transformers import Qwen3_5ForConditionalGeneration

        model = Qwen3_5ForConditionalGeneration(config).to(torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomise_(model, seed)
    return model.to(getattr(torch, dtype)).eval()


def save_cases(tmp_path_factory, cases: dict, seed: int) -> dict:
    """``cases``: name -> (family, config overrides); each built by :func:`build_hf_model`
    (float32) and saved to its own folder: name -> folder."""
    out = {}
    for name, (family, overrides) in cases.items():
        folder = tmp_path_factory.mktemp(name)
        build_hf_model(family, False, "float32", seed=seed, **overrides).save_pretrained(folder)
        out[name] = folder
    return out


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """Factory ``hf_model_dir(family, tied=False, dtype="float32", *, shard_size=None, **config_overrides)``
    -> folder with config.json + safetensors weights (sharded with an index when
    ``shard_size`` is given, e.g. "50KB"). Built once per argument set."""
    cache: dict = {}

    def make(family: str, tied: bool = False, dtype: str = "float32", *, shard_size: str | None = None,
             **overrides) -> Path:
        key = (family, tied, dtype, shard_size, tuple(sorted(overrides.items())))
        if key not in cache:
            name = f"{family}-{'tied' if tied else 'untied'}-{dtype}" + (f"-shard{shard_size}" if shard_size else "")
            if overrides:
                name += "-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
            folder = tmp_path_factory.mktemp(name)
            model = build_hf_model(family, tied, dtype, **overrides)
            kw = {"max_shard_size": shard_size} if shard_size else {}
            model.save_pretrained(folder, **kw)
            cache[key] = folder
        return cache[key]

    return make


@pytest.fixture(scope="session")
def hf_model():
    """Factory ``hf_model(folder, dtype)``: the transformers model of a checkpoint folder
    (eval mode, eager attention is not forced; sdpa is transformers' CPU default)."""
    cache: dict = {}

    def load(folder: Path, dtype: str = "float32"):
        key = (str(folder), dtype)
        if key not in cache:
            from transformers import AutoModelForCausalLM

            cache[key] = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
        return cache[key]

    return load


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The built-in default preset, cached once in the user's graphcp cache."""
    from graphcp.model.presets import ensure_preset

    return ensure_preset("default")
