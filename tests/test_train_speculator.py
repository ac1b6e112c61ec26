# The speculator recipe on a tiny random target: a few steps lower the loss, resume continues from the
# saved step, and the checkpoint loads through --draft mlp:PATH with greedy equality intact.
import json

import torch
from safetensors.torch import load_file

import tiny
from nanospec import LLM, SamplingParams
from test_engine import GREEDY, prompts
from train_speculator import parse_args, train


def test_training_lowers_loss_and_checkpoint_runs(tmp_path):
    target = tmp_path / "target"
    tiny.write_checkpoint(target, tiny.llama_like())
    tiny.write_char_tokenizer(target)
    workload = tmp_path / "prompts.jsonl"
    workload.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                                ["hello there", "the cat sat on the mat", "one two three", "abc abc abc"]))
    out = tmp_path / "spec"
    common = ["--model", str(target), "--out", str(out), "--prompts", str(workload), "--texts", str(workload),
              "--n-predict", "3", "--max-tokens", "48", "--batch-size", "64", "--lr", "3e-3", "--dtype", "float32",
              "--save-every", "10"]
    first = train(parse_args(common + ["--steps", "1"]))
    last = train(parse_args(common + ["--steps", "60"]))  # resumes at step 1 with the saved data
    assert json.loads((out / "train_state.json").read_text())["step"] == 60
    assert sum(last) < 0.8 * sum(first)
    # The embedding stays the target's; the vocabulary head is fine-tuned from the target's lm_head.
    weights, target_weights = load_file(out / "model.safetensors"), load_file(target / "model.safetensors")
    head = target_weights.get("lm_head.weight", target_weights["model.embed_tokens.weight"])
    assert torch.equal(weights["speculator.emb.0.weight"], target_weights["model.embed_tokens.weight"])
    assert not torch.equal(weights["speculator.head.0.weight"], head)
    assert torch.allclose(weights["speculator.head.0.weight"], head, atol=0.1)
    plain = LLM(str(target), dtype="float32", block_size=2, num_blocks=128)
    spec = LLM(str(target), dtype="float32", block_size=2, num_blocks=128, draft=f"mlp:{out}", num_spec_tokens=3)
    expected = [o.token_ids for o in plain.generate(prompts(6), GREEDY, use_progress=False)]
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
        assert len(llm.tokenizer.encode(prompt)) < len(where) <= len(llm.tokenizer.encode(prompt)) + 8
        generated = where[len(llm.tokenizer.encode(prompt)) - 1:-1]  # positions whose next token was generated
        assert data["greedy"][generated].tolist() == data["tokens"][generated + 1].tolist()
    read = collect(llm, prompts, max_tokens=0)
    assert len(read["tokens"]) == sum(len(llm.tokenizer.encode(p)) for p in prompts)
