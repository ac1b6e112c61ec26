# The speculator recipe on a tiny random target: a few steps lower the loss, and the checkpoint
# loads through --draft mlp:PATH with greedy equality intact.
import json

import tiny
import torch
from safetensors.torch import load_file, save_file
from test_engine import GREEDY, prompts

from models.mlp_speculator import VOCAB_FILE, load_speculator
from nanospec import LLM
from train_speculator import parse_args, train


def test_training_lowers_loss_and_checkpoint_runs(tmp_path):
    target = tmp_path / "target"
    tiny.write_checkpoint(target, tiny.llama_like())
    tiny.write_char_tokenizer(target)
    workload = tmp_path / "prompts.jsonl"
    workload.write_text(
        "".join(
            json.dumps({"prompt": p}) + "\n"
            for p in ["hello there", "the cat sat on the mat", "one two three", "abc abc abc"]
        )
    )
    out = tmp_path / "spec"
    common = [
        "--model",
        str(target),
        "--out",
        str(out),
        "--prompts",
        str(workload),
        "--n-predict",
        "3",
        "--max-tokens",
        "48",
        "--batch-size",
        "64",
        "--lr",
        "3e-3",
        "--dtype",
        "float32",
        "--draft-vocab",
        "24",
    ]
    first = train(parse_args(common + ["--steps", "1"]))
    # from scratch: its first step is the run above
    last = train(parse_args(common + ["--steps", "60"]))
    assert sum(last) < 0.8 * sum(first)
    # The embedding stays the target's; the vocabulary head is fine-tuned from the target's lm_head.
    weights, target_weights = (
        load_file(out / "model.safetensors"),
        load_file(target / "model.safetensors"),
    )
    head = target_weights.get("lm_head.weight", target_weights["model.embed_tokens.weight"])
    assert torch.equal(
        weights["speculator.emb.0.weight"], target_weights["model.embed_tokens.weight"]
    )
    assert not torch.equal(weights["speculator.head.0.weight"], head)
    assert torch.allclose(weights["speculator.head.0.weight"], head, atol=0.1)
    # --draft-vocab 24: only the 24 most frequent labels' rows were trained; the rest stay the
    # target's.
    token_ids = load_file(out / VOCAB_FILE)["token_ids"]
    assert len(token_ids) == 24 and token_ids.unique().tolist() == token_ids.tolist()
    outside = torch.ones(len(head), dtype=torch.bool)
    outside[token_ids] = False
    assert torch.equal(weights["speculator.head.0.weight"][outside], head[outside])
    plain = LLM(str(target), dtype="float32", block_size=2, num_blocks=128)
    spec = LLM(
        str(target),
        dtype="float32",
        block_size=2,
        num_blocks=128,
        draft=f"mlp:{out}",
        num_spec_tokens=3,
    )
    expected = [o.token_ids for o in plain.generate(prompts(6), GREEDY, use_progress=False)]
    assert spec.proposer.model.vocab_ids.tolist() == token_ids.tolist()
    outs = spec.generate(prompts(6), GREEDY, use_progress=False)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.num_accepted_tokens for o in outs) > 0


def test_collected_labels_are_the_targets_own_next_tokens(tmp_path):
    """Where the target generated the text itself, its greedy label after position t is token t+1;
    `doc` separates sequences so no example crosses from one into the next."""
    from train_speculator import collect

    tiny.write_checkpoint(tmp_path, tiny.llama_like())
    tiny.write_char_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_blocks=64)
    prompts = ["hello there", "one two three"]
    data = collect(llm, prompts, max_tokens=8)
    assert data["hidden"].shape == (len(data["tokens"]), llm.model.hidden_size)
    for doc, prompt in enumerate(prompts):
        where = (data["doc"] == doc).nonzero().flatten()
        assert (
            len(llm.tokenizer.encode(prompt)) < len(where) <= len(llm.tokenizer.encode(prompt)) + 8
        )
        # positions whose next token was generated
        generated = where[len(llm.tokenizer.encode(prompt)) - 1 : -1]
        assert data["greedy"][generated].tolist() == data["tokens"][generated + 1].tolist()


def test_reduced_vocabulary_scores_only_its_tokens(tmp_path):
    """With draft_vocab.safetensors beside the checkpoint, the heads give those tokens exactly
    the full heads' logits and every other token -inf (never proposed); the states they pass on
    are unchanged."""
    tiny.write_mlp_speculator(tmp_path, emb_dim=64, n_predict=3, tie_weights=True)
    full = load_speculator(str(tmp_path), "float32")
    token_ids = torch.tensor([3, 7, 8, 40, tiny.VOCAB - 1])
    save_file({"token_ids": token_ids}, tmp_path / VOCAB_FILE)
    reduced = load_speculator(str(tmp_path), "float32")
    outside = torch.ones(tiny.VOCAB, dtype=torch.bool)
    outside[token_ids] = False
    hidden, tokens = torch.randn(4, 64), torch.tensor([1, 2, 3, 4])
    full_state, reduced_state = full.first_state(hidden), reduced.first_state(hidden)
    for i in range(3):
        full_state, full_logits = full.step(i, full_state, tokens)
        reduced_state, logits = reduced.step(i, reduced_state, tokens)
        torch.testing.assert_close(reduced_state, full_state)
        torch.testing.assert_close(logits[:, token_ids], full_logits[:, token_ids])
        assert (logits[:, outside] == float("-inf")).all()
        tokens = logits.argmax(-1)
