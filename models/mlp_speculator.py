# IBM-style MLP speculator (ibm-fms "accelerator" checkpoints, arXiv 2404.19124): n_predict small heads
# that guess the next tokens from the target's final-norm hidden state and the last token. No KV cache,
# no attention: it must never need anything from the target except that hidden state.
import json
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from kernels import prepack_linears
from models import read_checkpoint, resolve_dtype


class SpeculatorNorm(nn.Module):
    """RMS-style LayerNorm with weight and bias (fms LayerNormParameterized, use_mean=False)."""

    def __init__(self, size: int, eps: float = 1e-6, affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size)) if affine else None
        self.bias = nn.Parameter(torch.zeros(size)) if affine else None

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x if self.weight is None else x * self.weight + self.bias


class MLPSpeculator(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.emb_dim, self.vocab_size, self.n_predict = config["emb_dim"], config["vocab_size"], config["n_predict"]
        self.inner_dim = config.get("inner_dim") or self.emb_dim
        self.scale_input = config.get("scale_input", False)
        self.tie_weights = config.get("tie_weights", False)
        n, inner = self.n_predict, self.inner_dim
        self.emb = nn.ModuleList(nn.Embedding(self.vocab_size, inner) for _ in range(n))
        self.proj = nn.ModuleList(nn.Linear(self.emb_dim if i == 0 else inner, inner, bias=False) for i in range(n))
        self.head = nn.ModuleList(nn.Linear(inner, self.vocab_size, bias=False) for _ in range(n))
        self.ln = nn.ModuleList(SpeculatorNorm(inner) for _ in range(n))
        self.ln0 = SpeculatorNorm(self.emb_dim, affine=False)
        # Keeps the state's scale steady across heads: state and token embedding mix with weights
        # whose squares sum to about one (see the fms implementation).
        self.state_weight = 0.5 ** (0.5 / n)
        self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * inner / 2)

    def first_state(self, hidden):
        return self.ln0(hidden) / math.sqrt(2) if self.scale_input else hidden

    def step(self, i: int, state, tokens):
        """Head i: (state, last token) -> (new state, logits over the vocabulary)."""
        state = self.proj[i](state) + self.emb[i](tokens) * (self.emb_weight / self.state_weight)
        state = F.gelu(self.ln[i](state))
        return state, self.head[i](state)


def tied_name(name: str) -> str:
    """With tie_weights, fms keeps one emb/head/ln for all heads and one proj for heads >= 1."""
    kind, i, rest = name.split(".", 2)
    return f"{kind}.{1 if kind == 'proj' and int(i) > 0 else 0}.{rest}"


def load_speculator(path: str, dtype="auto", device="cpu") -> MLPSpeculator:
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise FileNotFoundError(f"{config_file} not found (expected an MLP speculator folder)")
    config = json.load(open(config_file))
    if config.get("model_type") != "mlp_speculator":
        raise ValueError(f"{config_file}: model_type is {config.get('model_type')!r}, expected 'mlp_speculator'")
    with torch.device("meta"):
        model = MLPSpeculator(config)
    dtype = resolve_dtype(dtype, config)
    state = {k.removeprefix("speculator."): v for k, v in read_checkpoint(path, dtype).items()}
    weights = {}
    for name, param in model.state_dict().items():
        source = name if name in state or not model.tie_weights else tied_name(name)
        if source not in state:
            raise ValueError(f"{path}: speculator checkpoint is missing tensor 'speculator.{name}'")
        if state[source].shape != param.shape:
            raise ValueError(f"{path}: tensor 'speculator.{source}' has shape {tuple(state[source].shape)}, "
                             f"expected {tuple(param.shape)}")
        weights[name] = state[source]
    model.load_state_dict(weights, assign=True)
    return prepack_linears(model.to(device).eval())
