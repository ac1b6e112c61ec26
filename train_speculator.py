# Train an MLP speculator by self-distillation (arXiv 2404.19124): the target greedily continues
# prompts and the heads learn its greedy next token at every position from its final-norm hidden
# states. Writes an ibm-fms checkpoint (--draft mlp:DIR) plus the reduced vocabulary its heads score
# (draft_vocab.safetensors). It must never train on the prompts it is later evaluated on: pass
# held-apart prompts to bench.py.
import argparse
import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from bench import read_workload
from models import load_model, require
from models.mlp_speculator import VOCAB_FILE, MLPSpeculator, tied_name
from nanospec import LLM
from sequence import SamplingParams, Sequence

# The pretrained vocabulary head moves ten times slower than the new projections.
HEAD_LR_SCALE = 0.1


@torch.inference_mode()
def hidden_states(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """Final-norm hidden states [T, H] of one token sequence, outside any request (borrows KV
    blocks and gives them back)."""
    probe = Sequence(token_ids, SamplingParams(), llm.device)
    require(
        llm.blocks.ensure_slots(probe, len(token_ids)),
        f"{len(token_ids)} tokens do not fit in the free KV blocks",
    )
    try:
        return llm.forward(llm.model, [(probe, token_ids, 0)])
    finally:
        llm.blocks.free(probe)


@torch.inference_mode()
def collect(llm: LLM, prompts: list, max_tokens: int) -> dict:
    """The target's hidden states and greedy next tokens over each prompt plus its greedy
    continuation: tokens [N], hidden [N, H] (bf16), greedy [N] (the target's argmax next token
    after each position: a label wherever the text is not the target's own) and doc [N] (which
    sequence each position is in)."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    data = {"tokens": [], "hidden": [], "greedy": [], "doc": []}
    for doc, ids in enumerate(out.prompt_token_ids + out.token_ids for out in outs):
        hidden = hidden_states(llm, ids)
        data["tokens"].append(torch.tensor(ids))
        data["hidden"].append(hidden.to(torch.bfloat16).cpu())
        data["greedy"].append(llm.model.lm_head(hidden).argmax(-1).cpu())
        data["doc"].append(torch.full((len(ids),), doc))
    return {name: torch.cat(parts) for name, parts in data.items()}


def loss_per_head(spec: MLPSpeculator, data: dict, positions) -> list[torch.Tensor]:
    """Teacher forcing: head i reads the state and the token at positions + 1 + i, and learns the
    target's greedy token after it. Positions past the end of their sequence are left out."""
    tokens, doc = data["tokens"], data["doc"]
    state = spec.first_state(data["hidden"][positions].float())
    losses = []
    for i in range(spec.n_predict):
        inputs = (positions + 1 + i).clamp(max=len(tokens) - 1)
        labels = data["greedy"][inputs]
        valid = doc[inputs] == doc[positions]
        # a reduced head cannot score other tokens (their logits are -inf)
        if spec.vocab_ids is not None:
            valid &= torch.isin(labels, spec.vocab_ids)
        state, logits = spec.step(i, state, tokens[inputs])
        losses.append(F.cross_entropy(logits[valid], labels[valid]))
    return losses


def new_speculator(target_path: str, n_predict: int) -> tuple[MLPSpeculator, dict]:
    """Tied heads, inner_dim = hidden size; emb and head start from the target's own embeddings and
    lm_head. The embedding stays frozen. The head is fine-tuned (slowly, HEAD_LR_SCALE): it reads
    GELU outputs, which are never below -0.17, where the target's lm_head reads signed hidden states
    (frozen, the chat recipe's losses per head were 3.75 4.26 4.66; fine-tuned, 2.69 3.02 3.27)."""
    # readable weights, not C-packed ones
    target, _ = load_model(target_path, torch.float32, pack=False)
    config = dict(
        model_type="mlp_speculator",
        architectures=["MLPSpeculatorPreTrainedModel"],
        emb_dim=target.hidden_size,
        inner_dim=0,
        n_predict=n_predict,
        vocab_size=target.vocab_size,
        tie_weights=True,
        scale_input=True,
        torch_dtype="float32",
    )
    spec = MLPSpeculator(config)
    embed = next(m.weight for name, m in target.named_modules() if name.endswith("embed_tokens"))
    with torch.no_grad():
        # one emb, head and ln for all heads; proj 1..n shared
        for name, source in spec.tied_weights.items():
            module, _, param = name.rpartition(".")
            setattr(spec.get_submodule(module), param, spec.get_parameter(source))
        spec.emb[0].weight.copy_(embed.float())
        spec.head[0].weight.copy_(target.lm_head.weight.float())
    spec.emb[0].weight.requires_grad_(False)
    return spec, config


def frequent_tokens(labels: torch.Tensor, n: int, vocab_size: int) -> torch.Tensor:
    """The n tokens the target predicts most often in the data, in id order. Ties (among them the
    tokens never seen) go to lower ids, which byte-pair vocabularies give to more common pieces."""
    counts = torch.bincount(labels, minlength=vocab_size).double()
    return (
        torch.argsort(counts - torch.arange(vocab_size) / vocab_size, descending=True)[:n]
        .sort()
        .values
    )


def save(spec: MLPSpeculator, config: dict, out: str, full_head: torch.Tensor):
    os.makedirs(out, exist_ok=True)
    state = spec.state_dict()
    # the checkpoint keeps the full layout: trained rows among the target's
    if spec.vocab_ids is not None:
        state["head.0.weight"] = full_head.index_copy(0, spec.vocab_ids, state["head.0.weight"])
        save_file({"token_ids": spec.vocab_ids}, os.path.join(out, VOCAB_FILE))
    # tied once
    weights = {f"speculator.{n}": t.contiguous() for n, t in state.items() if tied_name(n) == n}
    save_file(weights, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def train(args):
    from rich.progress import Progress

    torch.manual_seed(args.seed)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=32)  # None: the default model
    spec, config = new_speculator(llm.model_path, args.n_predict)
    prompts = [p for f in args.prompts for p in read_workload(f, llm.tokenizer)][
        : args.max_prompts or None
    ]
    data = collect(llm, prompts, args.max_tokens)
    # Every position whose next token is in the same sequence is a training example.
    positions = (data["doc"][1:] == data["doc"][:-1]).nonzero().flatten()
    # a reduced head trains a copy of rows; save() puts them back
    full_head = spec.head[0].weight.detach()
    if 0 < args.draft_vocab < spec.vocab_size:
        spec.restrict_vocab(frequent_tokens(data["greedy"], args.draft_vocab, spec.vocab_size))
    head = spec.head[0].weight
    small = [p for p in spec.parameters() if p.requires_grad and p is not head]
    optimizer = torch.optim.AdamW(
        [{"params": small}, {"params": [head], "lr": args.lr * HEAD_LR_SCALE}],
        lr=args.lr,
        weight_decay=0.0,
    )
    generator = torch.Generator().manual_seed(args.seed)
    with Progress() as progress:
        task = progress.add_task("training", total=args.steps)
        for _ in range(args.steps):
            batch = positions[
                torch.randint(len(positions), (args.batch_size,), generator=generator)
            ]
            # bf16 matmuls (AMX on CPUs that have it) for the big vocabulary heads; weights stay
            # fp32.
            with torch.autocast(
                device_type="cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"
            ):
                losses = loss_per_head(spec, data, batch)
            optimizer.zero_grad()
            sum(losses).backward()
            optimizer.step()
            description = "loss " + " ".join(f"{loss.item():.2f}" for loss in losses)
            progress.update(task, advance=1, description=description)
    save(spec, config, args.out, full_head)
    return [loss.item() for loss in losses]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="train an MLP speculator by self-distillation")
    p.add_argument(
        "--model", help="target model folder (default: the embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument("--out", required=True, help="output folder (config.json + model.safetensors)")
    p.add_argument(
        "--prompts",
        nargs="+",
        default=["chat"],
        help="JSONL files and/or the built-in workload 'chat' (general requests); "
        "never 'grounded' or MT-bench, which bench.py holds apart for evaluation",
    )
    p.add_argument(
        "--max-prompts", type=int, default=0, help="use only the first N prompts (0: all)"
    )
    p.add_argument("--n-predict", type=int, default=3)
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=4096,
        help="heads score only the N tokens the target predicts most often in the data (0: all); "
        "written to draft_vocab.safetensors beside the full-vocabulary checkpoint",
    )
    p.add_argument(
        "--max-tokens", type=int, default=128, help="target continuation length per prompt"
    )
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--dtype",
        default="bfloat16",
        help="the target's dtype while collecting data (bfloat16 also autocasts training matmuls)",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    print("final loss per head:", train(parse_args()))
