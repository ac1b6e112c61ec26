# bench.py end to end on a tiny model: the flags users pass (--device, --dtype auto, a JSONL
# workload), and the JSON it writes (machine facts, identical-to-plain per row).
import json

import tiny

import bench


def test_bench_sweep_writes_machine_facts_and_identity(tmp_path):
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
