# bench.py end to end on a tiny model: the flags users pass (--device, --dtype auto, a JSONL
# workload), and the JSON it writes (machine facts, identical-to-plain per row).
import itertools
import json
import sys
import types

import pytest
import tiny
import torch

import bench
from nanospec import LLM


def test_bench_sweep_writes_machine_facts_and_identity(tmp_path, monkeypatch):
    # Every engine gets the --dtype the user gave, not the base engine's resolved dtype: under
    # AVX2, auto keeps fp16 weights where an explicit float32 would not, and plain would then
    # differ from speculation for a reason that is not speculation.
    dtypes = []
    monkeypatch.setattr(bench, "LLM", lambda *a, **kw: dtypes.append(kw["dtype"]) or LLM(*a, **kw))
    tiny.write_checkpoint(tmp_path / "model", tiny.llama_like())
    tiny.write_char_tokenizer(tmp_path / "model")
    workload = tmp_path / "prompts.jsonl"
    workload.write_text(
        "\n".join(json.dumps({"prompt": p}) for p in ["abcabcabc", "hello hello hello"])
    )
    out = tmp_path / "bench.json"
    bench.main(
        [
            "--model",
            str(tmp_path / "model"),
            "--device",
            "cpu",
            "--draft",
            "none,ngram",
            "--num-spec-tokens",
            "3,auto",
            "--batch-sizes",
            "1,2",
            "--workload",
            str(workload),
            "--no-chat",
            "--max-tokens",
            "12",
            "--repeat",
            "2",
            "--json",
            str(out),
        ]
    )
    assert dtypes == ["auto"] * 3  # plain, then the two speculative engines
    report = json.loads(out.read_text())
    assert report["machine"]["dtype"] in ("float32", "bfloat16") and report["machine"]["kernels"]
    rows = report["results"]
    assert [(r["method"], r["k"], r["batch"]) for r in rows] == [
        ("none", 0, 1),
        ("ngram", 3, 1),
        ("ngram", "auto", 1),
        ("none", 0, 2),
        ("ngram", 3, 2),
        ("ngram", "auto", 2),
    ]
    assert all(r["identical_to_plain"] for r in rows) and all(r["tok_s"] > 0 for r in rows)
    # The methods took turns; a ratio to plain is the median of the ratios within each repeat.
    plain = {r["batch"]: r["tok_s_runs"] for r in rows if r["method"] == "none"}
    for r in rows:
        ratios = sorted(a / b for a, b in zip(r["tok_s_runs"], plain[r["batch"]]))
        assert len(ratios) == 2 and abs(r["speedup_vs_plain"] - sum(ratios) / 2) < 1e-9


def test_llama_cpp_baseline_counts_what_nanospec_would(tmp_path, monkeypatch):
    """--baseline FILE.gguf: llama.cpp (a stand-in module here: llama-cpp-python is no dependency
    of nanospec) gets the engine's own token ids, starts each prompt afresh (no prefix kept from
    the one before), is asked for no token past EOS or --max-tokens, and its tok/s stands beside
    every row of batch 1 and no other."""
    tiny.write_checkpoint(tmp_path / "model", tiny.llama_like())
    tiny.write_char_tokenizer(tmp_path / "model")
    prompts = ["abcabcabc", "hello hello hello"]
    workload = tmp_path / "prompts.jsonl"
    workload.write_text("\n".join(json.dumps({"prompt": p}) for p in prompts))
    llm = LLM(str(tmp_path / "model"), dtype="float32")
    eos = min(llm.eos_ids)
    calls = []

    class Llama:  # the first prompt's 4th token is EOS; the second never ends
        def __init__(self, path, n_ctx, n_threads, n_threads_batch, verbose):
            assert path == "m.gguf" and n_threads == n_threads_batch == torch.get_num_threads()
            self.fresh = True

        def reset(self):
            self.fresh = True

        def generate(self, ids, temp):
            calls.append((ids, self.fresh, temp, []))  # [] : the tokens asked for
            self.fresh = False
            for i in itertools.count():
                calls[-1][3].append(i)
                yield eos if ids == llm.tokenizer.encode(prompts[0]) and i == 3 else 7

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=Llama))
    args = ["--model", str(tmp_path / "model"), "--workload", str(workload), "--no-chat"]
    args += ["--draft", "none,ngram", "--batch-sizes", "1,2", "--num-prompts", "2"]
    out = tmp_path / "bench.json"
    bench.main(
        args + ["--max-tokens", "6", "--repeat", "2", "--baseline", "m.gguf", "--json", str(out)]
    )
    _, *timed = calls  # (the first: a warm-up) then each repeat's prompts, batch 1 only
    assert [ids for ids, _, _, _ in timed] == [llm.tokenizer.encode(p) for p in prompts] * 2
    assert all(fresh for _, fresh, _, _ in timed) and all(temp == 0.0 for _, _, temp, _ in calls)
    assert [len(asked) for _, _, _, asked in timed] == [4, 6, 4, 6]  # EOS counted, none past
    rows = json.loads(out.read_text())["results"]
    for r in rows:
        assert (r["base_tok_s"] is not None) == (r["batch"] == 1)
        if r["batch"] == 1:
            assert r["speedup_vs_base"] == r["tok_s"] / r["base_tok_s"]


def test_an_unknown_baseline_is_an_error():
    """Neither none, hf nor a .gguf file: bench.py stops before it loads a model (argparse's
    choices could not name "a .gguf file")."""
    with pytest.raises(SystemExit, match="--baseline: none, hf or a .gguf file, not 'llama'"):
        bench.main(["--baseline", "llama"])


def test_a_baseline_that_does_not_import_is_named(tmp_path, monkeypatch):
    """--baseline hf where transformers fails to import (as 5.25 does beside Hugging Face's
    `kernels` package, whose import name is ours): a clear stop, not a traceback from inside it."""
    tiny.write_checkpoint(tmp_path / "model", tiny.llama_like())
    tiny.write_char_tokenizer(tmp_path / "model")
    monkeypatch.setitem(sys.modules, "transformers", None)  # (an import of it raises ImportError)
    with pytest.raises(SystemExit, match="--baseline hf: transformers does not import"):
        bench.main(["--model", str(tmp_path / "model"), "--baseline", "hf", "--no-chat"])


def test_two_turns_finds_turn_one_cached(tmp_path, capsys):
    """--two-turns: turn 2's prompt extends turn 1's prompt and answer, the engine with prefix
    caching finds them cached (whole blocks), the one without none, and both answer alike."""
    tiny.write_checkpoint(tmp_path / "model", tiny.llama_like())
    template = (
        "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}|{% endfor %}"
        "{% if add_generation_prompt %}a: {% endif %}"
    )
    tiny.write_char_tokenizer(tmp_path / "model", chat_template=template)
    workload = tmp_path / "turns.jsonl"
    turns = [["hello there, how are you", "and once more"], ["abc abc abc abc", "why?"]]
    workload.write_text("\n".join(json.dumps({"turns": t}) for t in turns))
    rows = bench.main(
        ["--model", str(tmp_path / "model"), "--two-turns", "--workload", str(workload)]
        + ["--dtype", "float32", "--max-tokens", "24", "--temperature", "0.8"]
    )
    assert len(rows) == 2
    for (prompt1, _, tokens1, _, _), turn2, without in rows:
        assert turn2[0] == without[0] > prompt1 + tokens1  # the same extended prompt
        # all of turn 1's tokens but its last (never computed) in whole blocks of 16
        assert turn2[1] >= (prompt1 + tokens1 - 1) // 16 * 16 > 0 and without[1] == 0
    assert "identical: True" in capsys.readouterr().out


def test_taking_turns_keeps_a_burst_to_one_round(monkeypatch):
    """`bench.py kernels` times its variants taking turns: a burst of other work that slows every
    call of one round (here the third: all three variants 3x) moves neither the median seconds nor
    the ratios, which are each round's own (T=5 is 1.2x T=1 in every round). Timed one variant
    after the other, or averaged, the same values would give other answers."""
    rounds = iter([1.0, 1.2, 1.6] * 2 + [3.0, 3.6, 4.8] + [1.0, 1.2, 1.6] * 2)
    monkeypatch.setattr(bench, "best_of", lambda fn, repeat: next(rounds))
    turns = bench.taking_turns({1: None, 5: None, 9: None}, rounds=5)
    assert list(turns) == [1, 5, 9]
    assert [round(float(s), 6) for s, _ in turns.values()] == [1.0, 1.2, 1.6]
    assert [round(float(r), 6) for _, r in turns.values()] == [1.0, 1.2, 1.6]
