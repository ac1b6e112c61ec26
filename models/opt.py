# OPT decoder: learned positions (offset 2), LayerNorm before or after each block, ReLU MLP, and
# project_in/project_out when word_embed_proj_dim differs from hidden_size. Same varlen forward and
# paged attention as every other model; never a model-specific attention path: OPT's is Llama's
# Attention without rotary.
import torch.nn.functional as F
from torch import nn

from models.llama import Attention, embedding

POSITION_OFFSET = 2  # OPT's learned position table reserves its first two rows


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        hidden, bias = config["hidden_size"], config.get("enable_bias", True)
        affine = config.get("layer_norm_elementwise_affine", True)
        self.pre_norm = config.get("do_layer_norm_before", True)
        self.self_attn = Attention(config, qkv_bias=bias, o_bias=bias, qk_norm=False)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.fc1 = nn.Linear(hidden, config["ffn_dim"], bias=bias)
        self.fc2 = nn.Linear(config["ffn_dim"], hidden, bias=bias)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)

    def forward(self, x, keep=None):
        """keep (the last layer's): the rows that go on past attention, as in models/llama.py."""
        x = self.residual_block(self.self_attn_layer_norm, self.self_attn, x)
        return self.residual_block(self.final_layer_norm, self.mlp, x if keep is None else x[keep])

    def residual_block(self, norm, block, x):
        x = block(norm(x) if self.pre_norm else x) + x
        return x if self.pre_norm else norm(x)

    def mlp(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class OPTForCausalLM(nn.Module):
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, config: dict, arch: str = "OPTForCausalLM"):
        super().__init__()
        activation = config.get("activation_function", "relu")
        if activation != "relu":
            raise ValueError(f"config.json: OPT activation {activation!r} is unsupported")
        hidden = config["hidden_size"]
        proj_dim = config.get("word_embed_proj_dim") or hidden
        # namespaces: parameter names are the checkpoint's ("model.decoder...")
        self.model = nn.Module()
        self.model.decoder = dec = nn.Module()
        dec.embed_tokens = embedding(config["vocab_size"], proj_dim)
        dec.embed_positions = embedding(config["max_position_embeddings"] + POSITION_OFFSET, hidden)
        # A layer the checkpoint lacks is an nn.Identity: no parameters, the forward passes through
        # it.
        projects = proj_dim != hidden
        dec.project_in = nn.Linear(proj_dim, hidden, bias=False) if projects else nn.Identity()
        dec.project_out = nn.Linear(hidden, proj_dim, bias=False) if projects else nn.Identity()
        # OPT-350m style (post-norm) checkpoints have no final norm.
        pre_norm = config.get("do_layer_norm_before", True)
        has_norm = pre_norm and not config.get("_remove_final_layer_norm")
        affine = config.get("layer_norm_elementwise_affine", True)
        dec.final_layer_norm = (
            nn.LayerNorm(hidden, elementwise_affine=affine) if has_norm else nn.Identity()
        )
        dec.layers = nn.ModuleList(
            OPTDecoderLayer(config) for _ in range(config["num_hidden_layers"])
        )
        self.hidden_size, self.vocab_size = proj_dim, config["vocab_size"]
        self.max_position_embeddings = config["max_position_embeddings"]
        self.lm_head = nn.Linear(self.hidden_size, self.vocab_size, bias=False)
        tied = config.get("tie_word_embeddings", True)
        self.tied_weights = {"lm_head.weight": "model.decoder.embed_tokens.weight"} if tied else {}

    @staticmethod
    def rename(name: str) -> str:
        # facebook/opt-* checkpoints store "decoder.*"; transformers' own save writes
        # "model.decoder.*".
        name = name.replace(".self_attn.out_proj.", ".self_attn.o_proj.")  # Attention's name for it
        return "model." + name if name.startswith("decoder.") else name

    def forward(self, input_ids, positions, keep=None):
        """As LlamaForCausalLM.forward: hidden states [T, H], or of the rows `keep`."""
        dec = self.model.decoder
        x = dec.project_in(dec.embed_tokens(input_ids))
        x = x + dec.embed_positions(positions + POSITION_OFFSET)
        *layers, last = dec.layers  # (unpacked, not sliced: as in models/llama.py)
        for layer in layers:
            x = layer(x)
        return dec.project_out(dec.final_layer_norm(last(x, keep)))
