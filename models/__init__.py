# Loading: a Hugging Face folder (config.json + safetensors + tokenizer.json) -> model, config,
# tokenizer. The architecture table is the only place that maps config.json to code. Weights come
# from safetensors only (never pickle), and a missing or mis-shaped tensor is an error naming the
# tensor and the folder.
import json
import os

import torch
from safetensors import safe_open

from kernels import auto_dtype, use_linears
from models.llama import LlamaForCausalLM
from models.opt import OPTForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def require(ok, problem: str):
    """Every invalid argument, model or request is a ValueError that names the problem."""
    if not ok:
        raise ValueError(problem)


def read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is not a directory")
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise FileNotFoundError(f"{config_file} not found (expected a Hugging Face model folder)")
    try:
        return json.load(open(config_file))
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file}: not valid JSON ({e})") from None


def resolve_dtype(dtype, config: dict, device="cpu") -> torch.dtype:
    """A torch dtype, a name, or "auto": chosen for the device from the checkpoint's
    (kernels.auto_dtype)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return auto_dtype(
            DTYPES.get(config.get("torch_dtype") or config.get("dtype"), torch.float32), device
        )
    require(
        dtype in DTYPES, f"dtype {dtype!r} is not supported (choose from auto, {', '.join(DTYPES)})"
    )
    return DTYPES[dtype]


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        shards = json.load(open(index))["weight_map"].values()
        return [os.path.join(path, s) for s in sorted(set(shards))]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(
        f"{path}: no model.safetensors or model.safetensors.index.json "
        "(pickle checkpoints are never loaded)"
    )


def read_checkpoint(path: str, dtype: torch.dtype, rename=lambda name: name, device="cpu") -> dict:
    state = {}
    for file in safetensors_files(path):  # a missing shard: safe_open's FileNotFoundError names it
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                # a buffer old checkpoints saved (recomputed)
                if not name.endswith("rotary_emb.inv_freq"):
                    state[rename(name)] = f.get_tensor(name).to(dtype)
    return state


def pack(state: dict, packed_modules: dict) -> dict:
    """Concatenate checkpoint tensors that the model runs as one matmul (q/k/v -> qkv_proj)."""
    for fused, parts in packed_modules.items():
        first = f".{parts[0]}."
        for key in [k for k in state if first in k]:
            keys = [key.replace(first, f".{p}.") for p in parts]
            if all(k in state for k in keys):
                state[key.replace(first, f".{fused}.")] = torch.cat([state.pop(k) for k in keys])
    return state


def load_weights(model: torch.nn.Module, path: str, dtype: torch.dtype, device):
    rename = getattr(model, "rename", lambda name: name)
    state = pack(read_checkpoint(path, dtype, rename, device), getattr(model, "packed_modules", {}))
    # one tensor, several names (a tied lm_head or head)
    for name, source in model.tied_weights.items():
        if name not in state and source in state:
            state[name] = state[source]
    expected = model.state_dict()
    for name, param in expected.items():
        require(name in state, f"{path}: checkpoint is missing tensor {name!r}")
        require(
            state[name].shape == param.shape,
            f"{path}: tensor {name!r} has shape "
            f"{tuple(state[name].shape)}, config.json implies {tuple(param.shape)}",
        )
    model.load_state_dict({name: state[name] for name in expected}, assign=True)


def load_model(path: str, dtype="auto", device="cpu", pack=True):
    """Build the model on the meta device (no memory, no init), then assign the checkpoint's
    tensors. pack=False keeps every linear's weight readable (for training code), not packed for
    the C kernels."""
    config = read_config(path)
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    require(
        arch,
        f"{path}: unsupported architecture {archs or config.get('model_type')!r} "
        f"(supported: {', '.join(ARCHITECTURES)})",
    )
    auto = dtype in (None, "auto")  # on a CPU: 16-bit weights under fp32 activations
    dtype = resolve_dtype(dtype, config, device)
    try:
        with torch.device("meta"):
            model = ARCHITECTURES[arch](config, arch)
    except KeyError as e:
        raise ValueError(f"{path}/config.json: missing field {e.args[0]!r}") from None
    load_weights(model, path, dtype, device)
    model = use_linears(model.to(device).eval(), pack, small_weights=auto)
    # On a CPU, safetensors' tensors are views of the file's memory mapping, which stays resident
    # as long as one of them lives. Copy the parameters packing left as they were (embeddings,
    # norms, biases), so that the file is unmapped (the buffers are computed, never loaded). With
    # the default model (a 0.5 GB fp32 file) the process held 1.15 GB after loading, and 0.74 GB
    # with the copies (0.1 GB of them).
    if torch.device(device).type == "cpu":
        for param in model.parameters():
            param.data = param.data.clone()
    # nn.Module keeps submodules and parameters in dicts of its own and finds each through
    # __getattr__ at every use (~0.3 us, 310 times a decode step of the default model): a copy in
    # each module's __dict__ is found directly. (nn.Module's __setattr__ drops the copy when a
    # submodule or parameter is replaced; nothing replaces them after loading.)
    for module in model.modules():
        module.__dict__.update(module._modules, **module._parameters)
    return model, config


class Tokenizer:
    """tokenizer.json (via `tokenizers`) plus tokenizer_config.json's chat template and special
    tokens."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as HFTokenizer

        self.tokenizer = HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config_file = os.path.join(path, "tokenizer_config.json")
        self.config = json.load(open(config_file)) if os.path.exists(config_file) else {}
        self.chat_template = self.config.get("chat_template")

    def encode(self, text: str, special: bool = True) -> list[int]:
        """special=False: no BOS or other tokens the tokenizer adds around a whole text."""
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decode_next(
        self, ids: list[int], prefix_offset: int, read_offset: int, final: bool = False
    ) -> tuple[str, tuple]:
        """Incremental detokenization: the text ids[read_offset:] add, decoded from prefix_offset
        (context for spacing), and the next offsets. An incomplete UTF-8 character waits for the
        next token, unless this is the final call (then it decodes as a replacement character, as
        decode() of the whole would)."""
        prefix = self.decode(ids[prefix_offset:read_offset])
        text = self.decode(ids[prefix_offset:])
        if final or len(text) > len(prefix) and not text.endswith("\ufffd"):
            return text[len(prefix) :], (read_offset, len(ids))
        return "", (prefix_offset, read_offset)

    def token_id(self, token) -> int | None:
        if isinstance(token, dict):  # older tokenizer_config.json stores AddedToken dicts
            token = token.get("content")
        return self.tokenizer.token_to_id(token) if token else None

    def apply_chat_template(self, messages: list[dict] | str) -> str:
        """The chat template's text for `messages`, or for one user message."""
        require(
            self.chat_template, "--chat: this model's tokenizer_config.json has no chat_template"
        )
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        # a downloaded template is untrusted code: keep it away from Python internals
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        special = {k: self.config.get(k) for k in ("bos_token", "eos_token")}
        try:
            template = env.from_string(self.chat_template)
            return template.render(messages=messages, add_generation_prompt=True, **special)
        # SecurityError, UndefinedError (an unsafe attribute), syntax
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from None


def load_tokenizer(path: str) -> Tokenizer | None:
    return Tokenizer(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None


def eos_token_ids(config: dict, tokenizer: Tokenizer | None) -> set[int]:
    ids, eos_token = set(), tokenizer and tokenizer.token_id(tokenizer.config.get("eos_token"))
    for source in (config.get("eos_token_id"), eos_token):
        if source is not None:
            ids.update(source if isinstance(source, list) else [source])
    return ids
