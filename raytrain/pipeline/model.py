"""Mistral as a list of pipeline-stage layers, in plain torch (no DeepSpeed here).

The model is the sequence ``[EmbeddingPipe, DecoderLayerPipe x L, FinalNormPipe, LMHeadPipe]``; pipeline layer
``i`` holds the tensors whose Hugging Face names start with ``hf_prefix(i, cfg)``, and the local parameter names
inside each layer are the rest of the Hugging Face name, so import/export is a rename by layer index:
``hf_key = hf_prefix(i, cfg) + local_name``.

Activations between layers are the tuple ``(hidden (B, T, H) float, position_ids (B, T) int64,
segment_ids (B, T) int64)``; the first layer takes ``(input_ids, position_ids, segment_ids)`` and the last returns
logits ``(B, T, V)``. Position and segment ids travel with the hidden states because every stage needs them
(RoPE and the attention mask are rebuilt per stage), and DeepSpeed passes integer tensors between stages without
gradients.
"""

from __future__ import annotations

import dataclasses
import json
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from raytrain.dataset.labels import IGNORE_INDEX
from raytrain.errors import ConfigError, RaytrainError
from raytrain.pipeline.attention import ATTENTION_IMPLS, packed_attention, prepare_attention


@dataclass(frozen=True)
class MistralConfig:
    """Architecture of a Mistral decoder (the fields of Hugging Face's MistralConfig that change the math)."""

    vocab_size: int
    """Number of token ids; the embedding and LM head have this many rows."""
    hidden_size: int
    """Width of the residual stream (H)."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_hidden_layers: int
    """Number of decoder layers (L)."""
    num_attention_heads: int
    """Query heads per layer."""
    num_key_value_heads: int
    """Key/value heads per layer (grouped-query attention); must divide num_attention_heads."""
    max_position_embeddings: int
    """Longest sequence the model is meant for (RoPE needs no table, this is metadata for export)."""
    head_dim: int | None = None
    """Width of one head; None means hidden_size // num_attention_heads (filled in by __post_init__)."""
    rms_norm_eps: float = 1e-5
    """Epsilon inside RMSNorm (Mistral-7B-v0.1 uses 1e-5)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    sliding_window: int | None = 4096
    """A query attends to at most this many most recent keys (itself included); None = full causal attention."""
    initializer_range: float = 0.02
    """Standard deviation of the normal init of linear and embedding weights."""
    tie_word_embeddings: bool = False
    """Must stay False: Mistral is untied, and a tied embedding across stages would need TiedLayerSpec."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"MistralConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                f"MistralConfig.num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ConfigError(
                    f"MistralConfig.hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                    f"({self.num_attention_heads}); set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2 != 0:
            raise ConfigError(f"MistralConfig.head_dim must be a positive even int (RoPE rotates pairs), "
                              f"got {self.head_dim!r}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ConfigError(f"MistralConfig.sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"MistralConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ConfigError(f"MistralConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.initializer_range > 0:
            raise ConfigError(f"MistralConfig.initializer_range must be > 0, got {self.initializer_range!r}")
        if self.tie_word_embeddings:
            raise ConfigError(
                "MistralConfig.tie_word_embeddings=True is not supported: Mistral keeps embed_tokens and lm_head "
                "separate, and tying them across pipeline stages would need DeepSpeed TiedLayerSpec. "
                "Set tie_word_embeddings: false.")

    @classmethod
    def preset(cls, name: str) -> MistralConfig:
        """Named architectures: 'mistral-7b' (v0.1 shape), 'tiny' / 'tiny-4l' (tests), 'small' (benchmarks)."""
        if name not in _PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(_PRESETS)}")
        return cls(**_PRESETS[name])

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> MistralConfig:
        """Build from a plain dict (e.g. YAML); unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown MistralConfig field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_hf_config(cls, hf_dir: str | os.PathLike) -> MistralConfig:
        """The architecture of a Hugging Face Mistral folder, read from its ``config.json``.

        Reads both layouts of the RoPE base: top-level ``rope_theta`` (the Mistral releases' files) and
        ``rope_parameters.rope_theta`` (transformers 5). Refuses what this model does not implement (another model
        type, another activation, RoPE scaling, tied embeddings) with the field named.
        """
        path = Path(hf_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path} is missing: model.preset=hf reads the architecture from model.init_from's "
                              "config.json (a save_pretrained folder)")
        hf = json.loads(path.read_text())
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        problems = []
        if hf.get("model_type") != "mistral":
            problems.append(f"model_type is {hf.get('model_type')!r}, not 'mistral'")
        if hf.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act is {hf.get('hidden_act')!r}, not 'silu'")
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            problems.append(f"RoPE scaling {rope!r} is not implemented (default RoPE only)")
        if hf.get("tie_word_embeddings"):
            problems.append("tie_word_embeddings is true (Mistral is untied)")
        if problems:
            raise ConfigError(f"{path}: " + "; ".join(problems))
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        fields = {name: hf[name] for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads", "num_key_value_heads",
                                              "max_position_embeddings", "head_dim", "rms_norm_eps",
                                              "initializer_range") if hf.get(name) is not None}
        return cls(**fields, rope_theta=float(theta), sliding_window=hf.get("sliding_window"))

    def math_fields(self) -> dict[str, Any]:
        """The fields that change what the weights compute (all but metadata: max_position_embeddings, init)."""
        return {k: v for k, v in self.to_dict().items() if k not in ("max_position_embeddings", "initializer_range")}

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (head_dim resolved); inverse of from_dict."""
        return dataclasses.asdict(self)

    def to_hf(self) -> Any:
        """The equivalent ``transformers.MistralConfig`` (imported lazily: transformers is heavy)."""
        from transformers import MistralConfig as HFMistralConfig

        return HFMistralConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": float(self.rope_theta)},
            sliding_window=self.sliding_window,
            initializer_range=self.initializer_range,
            tie_word_embeddings=False,
            hidden_act="silu",
            attention_dropout=0.0,
        )

    @property
    def num_pipeline_layers(self) -> int:
        """Embedding + decoder layers + final norm + LM head."""
        return self.num_hidden_layers + 3


_TINY = dict(vocab_size=32768, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048)
_PRESETS: dict[str, dict[str, Any]] = {
    "mistral-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                       rope_theta=10000.0, sliding_window=4096),
    "tiny": _TINY,
    "tiny-4l": {**_TINY, "num_hidden_layers": 4},
    # ~59M parameters (33.5M of them embedding + head): big enough to time, small enough for one GPU or a laptop.
    "small": dict(vocab_size=32768, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096),
}


# ----------------------------------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    """RMSNorm as in Hugging Face Mistral: normalise in fp32, scale by ``weight`` in the input dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, H) -> (B, T, H)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (B, T, head_dim) for integer positions (B, T).

    Computed from the positions on every call rather than cached in a buffer: a buffer would be cast to bf16 with
    the module (losing RoPE precision) and would differ per stage; the cost is a (B, T, D/2) outer product.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32)
                                / head_dim))  # (D/2,)
    freqs = position_ids[..., None].float() * inv_freq  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def check_num_stages(cfg: MistralConfig, num_stages: int) -> None:
    """The pipeline-depth rule: every stage holds at least one decoder layer, so 1 <= num_stages (train.pp) <=
    num_hidden_layers. ``stage_layer_ranges`` applies it before partitioning; the runner's preflight before any
    cluster work. ConfigError otherwise."""
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ConfigError(f"num_stages must be a positive int, got {num_stages!r}")
    if num_stages > cfg.num_hidden_layers:
        raise ConfigError(
            f"num_stages ({num_stages}) is larger than num_hidden_layers ({cfg.num_hidden_layers}): some stage "
            f"would hold no decoder layer. Use at most {cfg.num_hidden_layers} pipeline stages (train.pp).")


def model_config(preset: str, init_from: str = "") -> MistralConfig:
    """The architecture a job trains (job.model): a named preset, or "hf" = the config.json of ``init_from``."""
    if preset == "hf":
        if not init_from:
            raise ConfigError("model.preset=hf takes the architecture from model.init_from's config.json; set "
                              "model.init_from to a Hugging Face Mistral folder")
        return MistralConfig.from_hf_config(init_from)
    return MistralConfig.preset(preset)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE over packed documents; the kernel is chosen by
    ``raytrain.pipeline.attention.packed_attention`` ("dense": SDPA with an explicit mask, the default)."""

    def __init__(self, cfg: MistralConfig) -> None:
        super().__init__()
        head_dim = cfg.head_dim
        assert head_dim is not None  # resolved by MistralConfig.__post_init__
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim
        self.sliding_window = cfg.sliding_window
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segment_ids: torch.Tensor,
                impl: str = "dense", prepared: Any = None) -> torch.Tensor:
        """x (B, T, H), cos/sin (B, T, D), segment_ids (B, T) -> (B, T, H); ``prepared``: the attention's
        per-micro-batch tables (raytrain.pipeline.attention.prepare_attention), built here when None."""
        batch_size, seq_len, _ = x.shape
        q = self.q_proj(x).view(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, D)
        k = self.k_proj(x).view(batch_size, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, D)
        v = self.v_proj(x).view(batch_size, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = packed_attention(q, k, v, segment_ids, self.sliding_window, impl, prepared)  # (B, nh, T, D)
        out = out.transpose(1, 2).reshape(batch_size, seq_len, self.num_heads * self.head_dim)  # (B, T, nh*D)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: MistralConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, H) -> (B, T, H)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _layer_seed(seed: int, layer_index: int) -> int:
    # One generator per pipeline layer, so a layer's init does not depend on how the model is split into stages.
    return (seed * 1_000_003 + layer_index) % (2**63)


@torch.no_grad()
def init_weights(module: nn.Module, cfg: MistralConfig, seed: int, layer_index: int) -> None:
    """Hugging Face's init, made reproducible: RMSNorm weights = 1, every other weight ~ N(0, initializer_range).

    Draws on a CPU generator seeded by (seed, layer_index) in sorted parameter-name order and copies to the
    parameter's device. Parameters on the meta device (counting only) are left alone.
    """
    generator = torch.Generator().manual_seed(_layer_seed(seed, layer_index))
    norm_params = {id(m.weight) for m in module.modules() if isinstance(m, RMSNorm)}
    for _name, param in sorted(module.named_parameters()):
        if param.is_meta:
            continue
        if id(param) in norm_params:
            param.fill_(1.0)
        else:
            values = torch.empty(param.shape, dtype=torch.float32).normal_(
                0.0, cfg.initializer_range, generator=generator)
            param.copy_(values)


# ----------------------------------------------------------------------------------------------------------------
# Pipeline layers


class EmbeddingPipe(nn.Module):
    """Layer 0: (input_ids, position_ids, segment_ids) -> (hidden (B, T, H), position_ids, segment_ids)."""

    def __init__(self, cfg: MistralConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))  # HF: model.embed_tokens.weight
        init_weights(self, cfg, seed, 0)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        input_ids, position_ids, segment_ids = inputs
        return F.embedding(input_ids, self.weight), position_ids, segment_ids  # (B, T, H)


class _MicroBatchTables:
    """Tables derived from one micro-batch's position and segment ids (RoPE cos/sin, the attention's mask or
    segment bounds), built by the first decoder layer of a stage and reused by the others.

    The layers of a stage pass the same id tensors along (our layers return them unchanged, and DeepSpeed gives
    every micro-batch fresh tensors: received activations are cloned), so the tables are keyed by the tensors'
    identity through weak references: a freed tensor never matches, and a new micro-batch starts a new table.
    Activation-checkpoint recomputation of an older micro-batch simply rebuilds them. One per process.
    """

    def __init__(self) -> None:
        self._keys: tuple[weakref.ref, weakref.ref] | None = None
        self._values: dict[Any, Any] = {}

    def of(self, position_ids: torch.Tensor, segment_ids: torch.Tensor) -> _MicroBatchTables:
        if self._keys is None or self._keys[0]() is not position_ids or self._keys[1]() is not segment_ids:
            self._keys = (weakref.ref(position_ids), weakref.ref(segment_ids))
            self._values = {}
        return self

    def get(self, name: Any, build: Callable[[], Any]) -> Any:
        if name not in self._values:
            self._values[name] = build()
        return self._values[name]


_MICRO_BATCH_TABLES = _MicroBatchTables()


class DecoderLayerPipe(nn.Module):
    """Decoder layer ``layer_idx`` (0-based): pre-norm attention and SwiGLU MLP with residuals.

    Pipeline layer index is ``layer_idx + 1``. Maps the activation tuple to a new one, ids unchanged.
    ``attn_impl`` ("dense" | "segment" | "flex", see raytrain.pipeline.attention) picks the attention kernel; it is
    a plain attribute, so it can be switched on a built layer.
    """

    def __init__(self, cfg: MistralConfig, layer_idx: int, seed: int = 0, attn_impl: str = "dense") -> None:
        super().__init__()
        if attn_impl not in ATTENTION_IMPLS:
            raise ConfigError(f"DecoderLayerPipe attn_impl must be one of {list(ATTENTION_IMPLS)}, got {attn_impl!r}")
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.attn_impl = attn_impl
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        init_weights(self, cfg, seed, layer_idx + 1)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], block_mask: Any = None):
        """``block_mask``: a prebuilt FlexAttention BlockMask (attn_impl="flex" only). DeepSpeed passes only
        ``inputs``: then the stage's first layer builds the attention tables and RoPE once per micro-batch and the
        stage's other layers reuse them (``_MicroBatchTables``)."""
        hidden, position_ids, segment_ids = inputs  # (B, T, H), (B, T), (B, T)
        head_dim, window = self.cfg.head_dim, self.cfg.sliding_window
        assert head_dim is not None
        tables = _MICRO_BATCH_TABLES.of(position_ids, segment_ids)  # built by a stage's first layer, then reused
        cos, sin = tables.get(("rope", hidden.dtype, hidden.device),
                              lambda: rope_cos_sin(position_ids, head_dim, self.cfg.rope_theta, hidden.dtype))
        prepared = block_mask if block_mask is not None else tables.get(
            ("attention", self.attn_impl, window), lambda: prepare_attention(segment_ids, window, self.attn_impl))
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, segment_ids, self.attn_impl,
                                         prepared)
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, position_ids, segment_ids


class FinalNormPipe(RMSNorm):
    """Layer L+1: final RMSNorm on the hidden states; ids pass through."""

    def __init__(self, cfg: MistralConfig, seed: int = 0) -> None:
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps)  # HF: model.norm.weight
        self.cfg = cfg
        init_weights(self, cfg, seed, cfg.num_hidden_layers + 1)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):  # type: ignore[override]
        hidden, position_ids, segment_ids = inputs
        return super().forward(hidden), position_ids, segment_ids


class LMHeadPipe(nn.Module):
    """Layer L+2: hidden (B, T, H) -> logits (B, T, V) in the hidden dtype (the loss upcasts)."""

    def __init__(self, cfg: MistralConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))  # HF: lm_head.weight
        init_weights(self, cfg, seed, cfg.num_hidden_layers + 2)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden = inputs[0]
        return F.linear(hidden, self.weight)  # (B, T, V)


def layer_constructors(cfg: MistralConfig, seed: int = 0, attn_impl: str = "dense"
                       ) -> list[tuple[type[nn.Module], tuple, dict]]:
    """The pipeline layers in order, as (class, args, kwargs): the one definition of the layer sequence."""
    layers: list[tuple[type[nn.Module], tuple, dict]] = [(EmbeddingPipe, (cfg,), {"seed": seed})]
    layers += [(DecoderLayerPipe, (cfg, i), {"seed": seed, "attn_impl": attn_impl})
               for i in range(cfg.num_hidden_layers)]
    layers += [(FinalNormPipe, (cfg,), {"seed": seed}), (LMHeadPipe, (cfg,), {"seed": seed})]
    return layers


def build_sequential(cfg: MistralConfig, seed: int = 0, attn_impl: str = "dense") -> nn.Sequential:
    """All pipeline layers in one nn.Sequential (single-process reference, tests, parameter counting).

    Child ``i`` is pipeline layer ``i``, so ``state_dict`` keys are ``f"{i}.{local_name}"``.
    """
    return nn.Sequential(*[cls(*args, **kwargs) for cls, args, kwargs in layer_constructors(cfg, seed, attn_impl)])


LOSS_CHUNK_TOKENS = 1024
"""Tokens per cross-entropy chunk: at a 32,768-token vocabulary one fp32 chunk of logits is 128 MiB."""


def over_chunks(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], logits: torch.Tensor,
                labels: torch.Tensor, chunk_tokens: int = LOSS_CHUNK_TOKENS,
                recompute: bool | None = None) -> list[torch.Tensor]:
    """``fn(logits chunk, labels chunk)`` over ``chunk_tokens`` tokens at a time of the flat (N, V) logits and (N,)
    labels, so that ``fn``'s fp32 copies (the upcast logits, cross-entropy's log-probabilities) are made one chunk
    at a time; one call when they fit one chunk or gradients are off.

    ``recompute`` (default: on an accelerator, not on the CPU) runs each chunk under non-reentrant activation
    checkpointing: backward recomputes the chunk instead of keeping its fp32 tensors, which bounds an accelerator's
    memory (about 0.5 GB each per micro-batch at T = 4,096, V = 32,768) at the price of a second forward of the
    chunk; on the CPU host memory holds them and that forward is saved (bit for bit the same results). The chunks
    are ``split`` views: backward gathers the logits' gradient once from the chunks' gradients, where slices would
    each zero-fill and add a gradient of the logits' whole size (benchmarks/bench_loss.py)."""
    if labels.shape[0] <= chunk_tokens or not torch.is_grad_enabled():
        return [fn(logits, labels)]
    chunks = zip(logits.split(chunk_tokens), labels.split(chunk_tokens), strict=True)
    if recompute is None:
        recompute = logits.device.type != "cpu"
    if not recompute:
        return [fn(chunk, chunk_labels) for chunk, chunk_labels in chunks]
    from torch.utils.checkpoint import checkpoint

    return [checkpoint(fn, chunk, chunk_labels, use_reentrant=False) for chunk, chunk_labels in chunks]


def _chunk_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                   chunk_tokens: int = LOSS_CHUNK_TOKENS, recompute: bool | None = None) -> torch.Tensor:
    """fp32 cross-entropy over tokens whose label is not -100: their mean, or their sum times a given scale.

    ``labels`` (B, T) are already next-token targets aligned with ``logits`` (B, T, V) (the packer shifted them);
    no shift happens here. ``labels`` may come as ``(labels, loss_scale)``, as the training feed sends them
    (raytrain.trainer.feed: ``loss_scale = dp * m / targets of the global batch``): the result is then the summed
    token loss times ``loss_scale``, which DeepSpeed's accumulation and dp averaging turn into the mean over the
    global batch's target tokens. A batch with no target tokens gives 0 (not NaN), so one empty micro-batch does
    not poison the step.

    The logits are upcast ``chunk_tokens`` tokens at a time (``over_chunks``: neither the fp32 copy of the (B*T, V)
    logits nor cross-entropy's fp32 log-probabilities held whole on an accelerator). Equal to the one-shot loss and
    gradients (tests/unit/pipeline/test_chunked_loss.py).
    """
    loss_scale = None
    if isinstance(labels, tuple | list):
        labels, loss_scale = labels
    vocab_size = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab_size)  # (B*T, V), the head's dtype
    flat_labels = labels.reshape(-1).to(flat_logits.device)  # (B*T,)
    loss_sum = sum(over_chunks(_chunk_loss_sum, flat_logits, flat_labels, chunk_tokens, recompute))
    if loss_scale is not None:
        return loss_sum * loss_scale.to(loss_sum.device, torch.float32)
    num_targets = (flat_labels != IGNORE_INDEX).sum().clamp(min=1)
    return loss_sum / num_targets


def hf_prefix(layer_index: int, cfg: MistralConfig) -> str:
    """Hugging Face state-dict prefix of pipeline layer ``layer_index`` (0 .. L+2)."""
    num_layers = cfg.num_hidden_layers
    if layer_index == 0:
        return "model.embed_tokens."
    if 1 <= layer_index <= num_layers:
        return f"model.layers.{layer_index - 1}."
    if layer_index == num_layers + 1:
        return "model.norm."
    if layer_index == num_layers + 2:
        return "lm_head."
    raise RaytrainError(f"pipeline layer index {layer_index} is out of range 0..{num_layers + 2} for a model with "
                        f"num_hidden_layers={num_layers}")


def layer_parameter_counts(cfg: MistralConfig) -> list[int]:
    """Trainable parameters of each pipeline layer, counted on the meta device (no memory, no init)."""
    with torch.device("meta"):
        layers = build_sequential(cfg)
    return [sum(p.numel() for p in layer.parameters() if p.requires_grad) for layer in layers]


__all__ = [
    "IGNORE_INDEX", "MistralConfig", "model_config", "RMSNorm", "Attention", "MLP", "EmbeddingPipe", "DecoderLayerPipe",
    "FinalNormPipe", "LMHeadPipe", "rope_cos_sin", "init_weights", "layer_constructors",
    "build_sequential", "causal_lm_loss", "check_num_stages", "hf_prefix", "layer_parameter_counts",
]
