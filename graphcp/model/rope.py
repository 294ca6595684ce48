"""Rotary position embedding: the config, its inverse frequencies, and reading it from
a Hugging Face config.json.

Implemented types, computed as transformers computes them (``modeling_rope_utils``,
same order of operations, so the float32 tables agree bitwise):

- ``default``: ``1 / theta ** (2i / d)``;
- ``linear``: the default frequencies divided by ``factor``;
- ``llama3``: Llama 3.1's band-wise scaling (``factor``, ``low_freq_factor``,
  ``high_freq_factor``, ``original_max_position_embeddings``);
- ``yarn``: NTK-by-parts interpolation (``factor``, ``original_max_position_embeddings``,
  ``beta_fast``, ``beta_slow``, ``truncate``) and an attention factor that scales
  cos and sin (``attention_factor``, or derived from ``factor`` / ``mscale`` /
  ``mscale_all_dim``).

Everything else is refused with a message naming it: ``dynamic`` (dynamic NTK
rescales the frequencies with each sequence's length, so one table cannot serve a
batch), ``longrope``, unknown types, unknown keys, partial rotary embeddings,
per-layer-type RoPE, and ``rope_scaling`` / ``rope_parameters`` that disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from graphcp.checks import MAX_TOKENS, check_bool, check_choice, check_float, check_int
from graphcp.errors import ConfigError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: keys each type reads (besides rope_type / type / rope_theta / partial_rotary_factor)
_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
}
_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dims
    #: multiplies cos and sin (yarn); already resolved from mscale / mscale_all_dim
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        w = "RopeConfig"
        check_choice(self.rope_type, "rope_type", ROPE_TYPES, where=w)
        check_float(self.theta, "theta", lo=1, lo_open=True, where=w)  # log(theta) divides
        check_float(self.factor, "factor", lo=1.0, where=w)
        check_float(self.attention_factor, "attention_factor", lo=0, lo_open=True, where=w)
        check_int(self.original_max_position_embeddings, "original_max_position_embeddings", lo=1, hi=MAX_TOKENS,
                  where=w)
        check_float(self.beta_fast, "beta_fast", lo=0, lo_open=True, where=w)
        check_float(self.beta_slow, "beta_slow", lo=0, lo_open=True, where=w)
        check_bool(self.truncate, "truncate", where=w)
        lo = check_float(self.low_freq_factor, "low_freq_factor", lo=0, lo_open=True, where=w)
        hi = check_float(self.high_freq_factor, "high_freq_factor", lo=0, lo_open=True, where=w)
        if self.rope_type == "llama3" and hi <= lo:
            raise ConfigError(f"{w}: high_freq_factor must be > low_freq_factor={lo}, got {hi}")

    def _base_inv_freq(self, head_dim: int) -> torch.Tensor:
        return 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """float32 [head_dim // 2] inverse frequencies, scaling applied."""
        if self.rope_type == "yarn":
            return self._yarn_inv_freq(head_dim)
        inv = self._base_inv_freq(head_dim)
        if self.rope_type == "linear":
            inv /= self.factor
        elif self.rope_type == "llama3":
            inv = self._llama3(inv)
        return inv

    def _llama3(self, inv: torch.Tensor) -> torch.Tensor:
        low_wl = self.original_max_position_embeddings / self.low_freq_factor
        high_wl = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wl, inv / self.factor, inv)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        mid = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        return torch.where(mid, smoothed, scaled)

    def _yarn_inv_freq(self, dim: int) -> torch.Tensor:
        # transformers' _compute_yarn_parameters, step by step
        base, orig = self.theta, self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extra_factor = 1 - ramp
        return interpolation * (1 - extra_factor) + extrapolation * extra_factor


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context ``scale`` times the original (transformers'
    ``get_mscale``): the attention factor, and the softmax scale of DeepSeek's MLA."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_dict(d: dict, key: str, source: str) -> dict:
    raw = d.get(key)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {key} must be an object (rope_type, rope_theta, ...) or null, got {raw!r}"[:300])
    nested = [k for k, v in raw.items() if isinstance(v, dict)]
    if nested:
        raise ConfigError(f"{source}: {key} has per-layer-type entries {nested}; graphcp supports one RoPE for all "
                          "layers")
    out = dict(raw)
    if "type" in out:  # the legacy spelling of rope_type
        legacy = out.pop("type")
        if out.setdefault("rope_type", legacy) != legacy:
            raise ConfigError(f"{source}: {key} has type={legacy!r} and rope_type={out['rope_type']!r}")
    return out


def rope_from_hf(d: dict[str, Any], source: str, max_position_embeddings: int | None) -> RopeConfig:
    """The RoPE of a config.json, resolved as transformers resolves it: ``rope_parameters``
    (transformers 5) or ``rope_scaling`` + ``rope_theta`` (4.x); ``max_position_embeddings``
    is None when the file does not give it."""
    params = _rope_dict(d, "rope_parameters", source)
    scaling = _rope_dict(d, "rope_scaling", source)
    top_theta = d.get("rope_theta")
    if top_theta is not None:
        top_theta = check_float(top_theta, "rope_theta", lo=1, lo_open=True, where=source)
    default_theta = 10000.0 if top_theta is None else top_theta
    for key, p in (("rope_parameters", params), ("rope_scaling", scaling)):
        if p and top_theta is not None and p.get("rope_theta", top_theta) != top_theta:
            # transformers keeps the dict's and ignores the top-level one: a contradiction in the file
            raise ConfigError(f"{source}: rope_theta={top_theta} disagrees with {key}'s rope_theta="
                              f"{p['rope_theta']!r}; give it once")
        if p:
            p.setdefault("rope_type", "default")
            p.setdefault("rope_theta", default_theta)
    if params and scaling and params != scaling:
        # transformers would take rope_scaling whole and drop rope_parameters (its rope_theta
        # included): a silent choice the file's author probably did not mean
        diff = sorted(k for k in set(params) | set(scaling) if params.get(k) != scaling.get(k))
        shown = ", ".join(f"{k}: {scaling.get(k)!r} vs {params.get(k)!r}" for k in diff)
        raise ConfigError(f"{source}: rope_scaling and rope_parameters disagree ({shown}); "
                          "give the RoPE once (rope_parameters)")
    p = scaling or params or {"rope_type": "default", "rope_theta": default_theta}
    where = f"{source}: {'rope_scaling' if scaling else 'rope_parameters'}"
    rope_type = p["rope_type"]
    if rope_type == "dynamic":
        raise ConfigError(f"{where}: rope_type 'dynamic' (dynamic NTK) is not supported: it rescales the "
                          "frequencies with each sequence's length, so one RoPE table cannot serve a batch")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{where}: rope_type {rope_type!r} is not supported; graphcp implements "
                          f"{', '.join(ROPE_TYPES)}")
    unknown = sorted(set(p) - _COMMON - _KEYS[rope_type])
    if unknown:
        raise ConfigError(f"{where}: key {unknown[0]!r} is not understood for rope_type {rope_type!r} "
                          f"(graphcp reads {sorted(_KEYS[rope_type] | {'rope_type', 'rope_theta'})})")
    for key, value in (("partial_rotary_factor", p.get("partial_rotary_factor")),
                       ("partial_rotary_factor", d.get("partial_rotary_factor"))):
        if value is not None and check_float(value, key, where=source) != 1.0:
            raise ConfigError(f"{source}: partial_rotary_factor={value!r} (rotating part of each head) is not "
                              "supported; expected 1.0")
    theta = check_float(p["rope_theta"], "rope_theta", lo=1, lo_open=True, where=where)
    if rope_type == "default":
        return RopeConfig(theta=theta)
    kw: dict[str, Any] = {"theta": theta, "rope_type": rope_type}
    if rope_type in ("llama3", "yarn"):
        # transformers: a top-level original_max_position_embeddings wins (Phi-3's layout),
        # then the RoPE dict's, then max_position_embeddings
        orig = d.get("original_max_position_embeddings", p.get("original_max_position_embeddings"))
        orig_where = source if "original_max_position_embeddings" in d else where
        if orig is None:
            if max_position_embeddings is None:
                raise ConfigError(f"{where}: rope_type {rope_type!r} needs original_max_position_embeddings "
                                  "(or max_position_embeddings)")
            orig = max_position_embeddings
        kw["original_max_position_embeddings"] = check_int(orig, "original_max_position_embeddings", lo=1,
                                                           hi=MAX_TOKENS, where=orig_where)
    factor = p.get("factor")
    if factor is None and rope_type == "yarn" and "factor" in p and max_position_embeddings is not None:
        factor = max_position_embeddings / kw["original_max_position_embeddings"]  # transformers' fallback
    if factor is None:
        raise ConfigError(f"{where}: rope_type {rope_type!r} needs a factor")
    kw["factor"] = check_float(factor, "factor", lo=1.0, where=where)
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in p:
                raise ConfigError(f"{where}: rope_type 'llama3' needs {key}")
            kw[key] = check_float(p[key], key, lo=0, lo_open=True, where=where)
        if kw["high_freq_factor"] <= kw["low_freq_factor"]:
            raise ConfigError(f"{where}: high_freq_factor must be > low_freq_factor={kw['low_freq_factor']}, "
                              f"got {kw['high_freq_factor']}")
    if rope_type == "yarn":
        kw.update(_yarn_fields(p, kw["factor"], where))
    return RopeConfig(**kw)


def _yarn_fields(p: dict, factor: float, where: str) -> dict:
    # transformers treats 0 / null betas as unset (``or 32``), and mscale only with mscale_all_dim
    out: dict[str, Any] = {}
    for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        v = p.get(key)
        out[key] = check_float(v, key, lo=0, lo_open=True, where=where) if v else default
    if out["beta_fast"] < out["beta_slow"]:
        raise ConfigError(f"{where}: beta_fast={out['beta_fast']} must be >= beta_slow={out['beta_slow']}")
    if "truncate" in p:
        out["truncate"] = check_bool(p["truncate"], "truncate", where=where)
    mscale = p.get("mscale")
    mscale_all = p.get("mscale_all_dim")
    mscale = None if mscale is None else check_float(mscale, "mscale", where=where)
    mscale_all = None if mscale_all is None else check_float(mscale_all, "mscale_all_dim", where=where)
    if p.get("attention_factor") is not None:
        out["attention_factor"] = check_float(p["attention_factor"], "attention_factor", lo=0, lo_open=True,
                                              where=where)
    elif mscale and mscale_all:
        out["attention_factor"] = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all))
    else:
        out["attention_factor"] = yarn_mscale(factor)
    if out["attention_factor"] <= 0:
        raise ConfigError(f"{where}: the attention factor from mscale={mscale} and mscale_all_dim={mscale_all} is "
                          f"{out['attention_factor']}; expected > 0")
    return out
