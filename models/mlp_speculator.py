# IBM-style MLP speculator (ibm-fms "accelerator" checkpoints, arXiv 2404.19124): n_predict small
# heads that guess the next tokens from the target's final-norm hidden state and the last token. No
# KV cache, no attention: it must never need anything from the target except that hidden state.
import math
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from kernels import use_linears
from models import load_weights, read_config, require, resolve_dtype

# Optional, beside the ibm-fms layout: the token ids a reduced head scores (other engines ignore the
# file).
VOCAB_FILE = "draft_vocab.safetensors"


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
        self.emb_dim, self.vocab_size = config["emb_dim"], config["vocab_size"]
        self.n_predict = n = config["n_predict"]
        self.inner_dim = inner = config.get("inner_dim") or self.emb_dim
        self.scale_input = config.get("scale_input", False)
        tied = config.get("tie_weights", False)
        self.emb = nn.ModuleList(nn.Embedding(self.vocab_size, inner) for _ in range(n))
        self.proj = nn.ModuleList(
            nn.Linear(inner if i else self.emb_dim, inner, False) for i in range(n)
        )
        self.head = nn.ModuleList(nn.Linear(inner, self.vocab_size, bias=False) for _ in range(n))
        self.ln = nn.ModuleList(SpeculatorNorm(inner) for _ in range(n))
        self.ln0 = SpeculatorNorm(self.emb_dim, affine=False)
        # Keeps the state's scale steady across heads: state and token embedding mix with weights
        # whose squares sum to about one (see the fms implementation).
        self.state_weight = 0.5 ** (0.5 / n)
        self.emb_weight = math.sqrt((1 - self.state_weight**2) * inner / 2)
        # Set by restrict_vocab: the token ids the heads score (None: all). A buffer, so .to(device)
        # moves it.
        self.register_buffer("vocab_ids", None, persistent=False)
        # With tie_weights, fms keeps one emb, head and ln for all heads and one proj for heads >=
        # 1.
        self.tied_weights = {name: tied_name(name) for name in self.state_dict()} if tied else {}

    @staticmethod
    def rename(name: str) -> str:  # the checkpoint's names: "speculator.emb.0.weight"
        return name.removeprefix("speculator.")

    def first_state(self, hidden):
        return self.ln0(hidden) / math.sqrt(2) if self.scale_input else hidden

    def step(self, i: int, state, tokens):
        """Head i: (state, last token) -> (new state, logits over the vocabulary)."""
        state = self.proj[i](state) + self.emb[i](tokens) * (self.emb_weight / self.state_weight)
        state = F.gelu(self.ln[i](state))
        logits = self.head[i](state)
        if self.vocab_ids is None:
            return state, logits
        # A reduced head scores only its tokens; every other token gets -inf, so it is never
        # proposed. That never costs correctness: acceptance (coupled, or the rejection sampler) is
        # lossless for any draft distribution.
        full = logits.new_full((len(logits), self.vocab_size), float("-inf"))
        return state, full.index_copy_(1, self.vocab_ids, logits)

    def restrict_vocab(self, token_ids: torch.Tensor):
        """Keep only these rows of the vocabulary heads. Each head is as costly as the target's
        lm_head (a 49k x 576 GEMV for SmolLM2, 5 ms on a 2-core CPU); the target's frequent
        tokens cost a tenth."""
        rows = {}  # tied heads share one tensor; they keep sharing one (smaller) parameter
        for head in self.head:
            if id(head.weight) not in rows:
                rows[id(head.weight)] = nn.Parameter(
                    head.weight.detach()[token_ids].contiguous(),
                    requires_grad=head.weight.requires_grad,
                )
            head.weight, head.out_features = rows[id(head.weight)], len(token_ids)
        self.vocab_ids = token_ids


def tied_name(name: str) -> str:
    """The tensor a tied checkpoint stores for parameter `name`."""
    kind, i, rest = name.split(".", 2)
    return f"{kind}.{1 if kind == 'proj' and int(i) > 0 else 0}.{rest}"


def load_speculator(path: str, dtype="auto", device="cpu") -> MLPSpeculator:
    config = read_config(path)
    require(
        config.get("model_type") == "mlp_speculator",
        f"{path}: model_type {config.get('model_type')!r} is not 'mlp_speculator'",
    )
    with torch.device("meta"):
        model = MLPSpeculator(config)
    load_weights(model, path, resolve_dtype(dtype, config, device), device)
    vocab_file = os.path.join(path, VOCAB_FILE)
    if os.path.exists(vocab_file):
        model.restrict_vocab(read_vocab(vocab_file, model.vocab_size))
    return use_linears(model.to(device).eval())


def read_vocab(vocab_file: str, vocab_size: int) -> torch.Tensor:
    token_ids = load_file(vocab_file).get("token_ids")
    require(
        token_ids is not None and token_ids.dim() == 1 and len(token_ids) > 0,
        f"{vocab_file}: expected a 1-d tensor 'token_ids'",
    )
    in_range = 0 <= token_ids.min() and token_ids.max() < vocab_size
    require(
        in_range and len(token_ids.unique()) == len(token_ids),
        f"{vocab_file}: 'token_ids' must be distinct ids in [0, {vocab_size})",
    )
    return token_ids.long()
