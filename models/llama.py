# Llama / Mistral / Qwen2 / Qwen3 decoder: one implementation, the differences are flags read from
# config.json (q/k/v bias, q/k RMSNorm, explicit head_dim, llama3 rope scaling, tied lm_head).
# The forward is the single varlen forward of DESIGN.md; it never sees batch or padding shapes.
import math

import torch
from torch import nn

from kernels import attention, rms_norm, rms_norm_linear, silu_mul_linear


def rope_cache(config: dict, head_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] float32 = [cos | sin] of position * inv_freq, the inverse
    frequencies with llama3 scaling when config asks for it."""
    # transformers 5 writes `rope_parameters`; older checkpoints have `rope_theta` + `rope_scaling`.
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"config.json: unsupported rope scaling type {rope_type!r}")
    if rope_type == "llama3":
        factor, old_len = rope["factor"], rope["original_max_position_embeddings"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        low_wavelen, high_wavelen, wavelen = old_len / low, old_len / high, 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def embedding(rows: int, dim: int) -> nn.Embedding:
    """An nn.Embedding the checkpoint fills (load_model builds models on the meta device). Not
    nn.Embedding(rows, dim): its random init on the meta device imports torch._dynamo, 1.1 s of
    every start-up."""
    return nn.Embedding.from_pretrained(torch.empty(rows, dim))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.empty(size)), eps

    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, self.eps, residual)

    __call__ = forward  # past nn.Module's hook dispatch, as kernels.Linear


class Attention(nn.Module):
    def __init__(self, config: dict, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        # q, k and v (and gate/up below) are packed into one matmul: fewer, larger ops per layer.
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm:  # Qwen3: RMSNorm over each head's q and k before rotary
            self.q_norm = RMSNorm(self.head_dim, config["rms_norm_eps"])
            self.k_norm = RMSNorm(self.head_dim, config["rms_norm_eps"])
        # views into the engine's KV pool, set by allocate_kv_cache
        self.k_cache = self.v_cache = None

    def forward(self, x, cos_sin=None):  # cos_sin None: no rotary (OPT)
        return self.attend(self.qkv_proj(x), cos_sin)

    def attend(self, qkv, cos_sin=None):
        """What follows the qkv projection (DecoderLayer computes it with the norm before it)."""
        # attention() takes q, k and v as they sit side by side in each row of qkv: on a CPU the
        # C call reads them there (a view of each would cost more than the call's own Python).
        if self.qk_norm:  # Qwen3: RMSNorm over each head's q and k, in place (qkv is our own)
            heads = qkv.view(len(qkv), -1, self.head_dim)
            q, k = heads[:, : self.num_heads], heads[:, self.num_heads : -self.num_kv_heads]
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        return self.o_proj(attention(qkv, cos_sin, self.k_cache, self.v_cache, self.scale))

    __call__ = forward  # past nn.Module's hook dispatch, as kernels.Linear


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, gate_up):
        """The MLP past gate_up_proj (DecoderLayer computes it with the norm before it)."""
        return silu_mul_linear(gate_up, self.down_proj)

    __call__ = forward  # past nn.Module's hook dispatch, as kernels.Linear


class DecoderLayer(nn.Module):
    def __init__(self, config: dict, **attn_flags):
        super().__init__()
        hidden = config["hidden_size"]
        self.self_attn = Attention(config, **attn_flags)
        self.mlp = MLP(hidden, config["intermediate_size"], config.get("mlp_bias", False))
        self.input_layernorm = RMSNorm(hidden, config["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(hidden, config["rms_norm_eps"])

    def forward(self, x, residual, cos_sin, keep=None):
        """keep (the last layer's): the rows that go on past attention, LlamaForCausalLM.forward."""
        # The residual stream is carried separately so each norm can fuse "add residual, then norm",
        # and each norm goes with the projection after it: on a CPU, one C call (rms_norm_linear).
        norm, qkv_proj = self.input_layernorm, self.self_attn.qkv_proj
        qkv, residual = rms_norm_linear(x, residual, norm, qkv_proj)
        x = self.self_attn.attend(qkv, cos_sin)
        if keep is not None:
            x, residual = x[keep], residual[keep]
        norm, gate_up_proj = self.post_attention_layernorm, self.mlp.gate_up_proj
        gate_up, residual = rms_norm_linear(x, residual, norm, gate_up_proj)
        return self.mlp(gate_up), residual

    __call__ = forward  # past nn.Module's hook dispatch, as kernels.Linear


class LlamaForCausalLM(nn.Module):
    """Also Mistral, Qwen2 and Qwen3: `arch` picks the flags."""

    packed_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(self, config: dict, arch: str = "LlamaForCausalLM"):
        super().__init__()
        bias = config.get("attention_bias", False)
        flags = dict(qkv_bias=bias, o_bias=bias, qk_norm=arch == "Qwen3ForCausalLM")
        if arch == "Qwen2ForCausalLM":  # Qwen2 always has q/k/v bias and never an o_proj bias
            flags.update(qkv_bias=True, o_bias=False)
        self.hidden_size, self.vocab_size = config["hidden_size"], config["vocab_size"]
        # a namespace: parameter names are the checkpoint's ("model.layers.0...")
        self.model = nn.Module()
        self.model.embed_tokens = embedding(self.vocab_size, self.hidden_size)
        layers = (DecoderLayer(config, **flags) for _ in range(config["num_hidden_layers"]))
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = RMSNorm(self.hidden_size, config["rms_norm_eps"])
        self.lm_head = nn.Linear(self.hidden_size, self.vocab_size, bias=False)
        # A tied head is the embedding matrix itself: the loader fills lm_head.weight from it.
        tied = config.get("tie_word_embeddings", False)
        self.tied_weights = {"lm_head.weight": "model.embed_tokens.weight"} if tied else {}
        self.max_position_embeddings = config.get("max_position_embeddings", 4096)
        window = config.get("sliding_window")
        if window and (arch == "MistralForCausalLM" or config.get("use_sliding_window")):
            # Sliding-window attention is not implemented; within the window it equals full
            # attention, so the context is capped there rather than silently computing something
            # else.
            self.max_position_embeddings = min(self.max_position_embeddings, window)
        # rope_cache builds on the CPU explicitly: models are constructed on the meta device.
        cos_sin = rope_cache(
            config, self.model.layers[0].self_attn.head_dim, self.max_position_embeddings
        )
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(self, input_ids, positions, keep=None):
        """Packed tokens [T] at positions [T] -> final-norm hidden states [T, H], or those of the
        rows `keep` (a tensor of row indices). Every row's K/V is still written (every layer's
        attention runs on all rows); past the last layer's attention only the kept rows go on, as
        llama.cpp does: a step samples from a few rows, and a prompt's other rows need no MLP at
        the top (a 466-token prefill of the default model took 0.97x the time; BENCHMARKS.md,
        session 42). Row-invariant kernels give the kept rows the bits they get among all."""
        x, residual = self.model.embed_tokens(input_ids), None
        # Every layer rotates at the same positions: gather their cos/sin rows once per forward,
        # rounded to the model's dtype as transformers does.
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(x.dtype)
        # (unpacked, not sliced: slicing an nn.ModuleList builds a new one, 0.14 ms a forward)
        *layers, last = self.model.layers
        for layer in layers:
            x, residual = layer(x, residual, cos_sin)
        x, residual = last(x, residual, cos_sin, keep)
        x, _ = self.model.norm(x, residual)
        return x
