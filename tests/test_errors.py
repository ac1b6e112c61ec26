# Bad input gets one clear error naming the problem, never a crash deep inside, and never leaks KV
# blocks or disturbs other requests.
import json
import subprocess
import sys
from pathlib import Path

import pytest
import tiny
import torch
from safetensors.torch import load_file, save_file

from nanospec import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tiny.write_checkpoint(path, tiny.llama_like())
    return path


def copy_folder(src, dst, edit_config=None, edit_tensors=None):
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(src / "model.safetensors")
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, dst / "model.safetensors")
    return str(dst)


def test_bad_model_folders(folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))
    arch = copy_folder(
        folder, tmp_path / "arch", lambda c: c.update(architectures=["GPTNeoXForCausalLM"])
    )
    with pytest.raises(ValueError, match="unsupported architecture.*GPTNeoX"):
        LLM(arch)
    field = copy_folder(folder, tmp_path / "field", lambda c: c.pop("hidden_size"))
    with pytest.raises(ValueError, match="missing field 'hidden_size'"):
        LLM(field)
    missing = copy_folder(
        folder,
        tmp_path / "missing_tensor",
        edit_tensors=lambda t: t.pop("model.layers.1.mlp.down_proj.weight"),
    )
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.mlp.down_proj.weight'"):
        LLM(missing)
    shape = copy_folder(folder, tmp_path / "shape", lambda c: c.update(intermediate_size=80))
    with pytest.raises(ValueError, match="gate_up_proj.weight' has shape"):
        LLM(shape)
    (tmp_path / "bad_json").mkdir()
    (tmp_path / "bad_json" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(str(tmp_path / "bad_json"))
    pickle_only = tmp_path / "pickle_only"
    pickle_only.mkdir()
    (pickle_only / "config.json").write_text((folder / "config.json").read_text())
    torch.save({}, pickle_only / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pickle checkpoints are never loaded"):
        LLM(str(pickle_only))
    with pytest.raises(ValueError, match="dtype 'float8'"):
        LLM(str(folder), dtype="float8")


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("max_tokens", 0),
        ("stop", [""]),
        ("num_spec_tokens", -2),
    ],
)
def test_impossible_sampling_params(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_bad_requests_leave_engine_clean(folder):
    llm = LLM(str(folder), dtype="float32", block_size=4, num_blocks=8, max_model_len=40)
    good = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with pytest.raises(ValueError, match="prompt has 40 tokens but the context is 40"):
        llm.generate([[5, 6], list(range(3, 43))], good)
    with pytest.raises(ValueError, match="needs 9 KV blocks but the pool has 8"):
        llm.generate([[5] * 30], SamplingParams(max_tokens=6))
    with pytest.raises(ValueError, match="token ids must be ints"):
        llm.generate([[5, 1000]], good)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]], good)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["text"], good)
    assert not llm.has_unfinished() and llm.blocks.num_used_blocks == 0
    reference = LLM(str(folder), dtype="float32", block_size=4, num_blocks=8).generate(
        [[5, 6]], good
    )
    assert llm.generate([[5, 6]], good)[0].token_ids == reference[0].token_ids


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where there is no GPU")
def test_cuda_without_a_gpu_is_named(folder):
    # (without the check, the first pinned-memory copy failed, naming pin_memory, not the device)
    with pytest.raises(ValueError, match="device 'cuda' is not available"):
        LLM(str(folder), device="cuda")
    assert LLM(str(folder), device=torch.device("cpu"), num_blocks=4).device.type == "cpu"


def test_bad_spec_configs(folder, tmp_path):
    with pytest.raises(ValueError, match="needs a draft"):
        LLM(str(folder), num_spec_tokens=3)
    other_vocab = tmp_path / "other_vocab"
    tiny.write_checkpoint(other_vocab, tiny.llama_like(vocab_size=100))
    with pytest.raises(ValueError, match="draft vocabulary"):
        LLM(str(folder), draft=str(other_vocab), num_spec_tokens=2)
    tiny.write_mlp_speculator(tmp_path / "mlp", emb_dim=64, n_predict=2)
    with pytest.raises(ValueError, match="exceeds the speculator's n_predict 2"):
        LLM(str(folder), draft=f"mlp:{tmp_path / 'mlp'}", num_spec_tokens=3)
    llm = LLM(str(folder), draft=f"mlp:{tmp_path / 'mlp'}", num_spec_tokens=2, num_blocks=16)
    out = llm.generate(
        [[5, 6]], SamplingParams(num_spec_tokens=3, max_tokens=4), use_progress=False
    )[0]
    assert out.num_draft_tokens <= 2 * out.num_spec_steps  # a request's K is capped by the engine's
    save_file(
        {"token_ids": torch.tensor([1, 2, tiny.VOCAB])},
        tmp_path / "mlp" / "draft_vocab.safetensors",
    )
    with pytest.raises(
        ValueError, match=r"draft_vocab.safetensors: 'token_ids' must be distinct ids in \[0, "
    ):
        LLM(str(folder), draft=f"mlp:{tmp_path / 'mlp'}", num_spec_tokens=2)
    tiny.write_mlp_speculator(tmp_path / "mlp_wide", emb_dim=32, n_predict=2)
    with pytest.raises(ValueError, match="does not fit the target"):
        LLM(str(folder), draft=f"mlp:{tmp_path / 'mlp_wide'}", num_spec_tokens=2)
    with pytest.raises(ValueError, match="ngram_min"):
        LLM(str(folder), draft="ngram", num_spec_tokens=2, ngram_min=3, ngram_max=2)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/no/such/model"], "is not a directory"),
        (["--temperature", "-1"], "SamplingParams.temperature"),
        (["--max-tokens", "0"], "SamplingParams.max_tokens"),
        (["--max-model-len", "4", "--prompt", "a long prompt here"], "but the context is 4"),
        (["--block-size", "0"], "block_size must be >= 1"),
        (["--max-model-len", "0"], "max_model_len must be >= 1"),
        (["--device", "tpu"], "device 'tpu' is not available"),
    ],
)
def test_cli_errors_are_one_line(folder, args, message):
    if "--model" not in args:
        args = ["--model", str(folder)] + args
        tiny.write_char_tokenizer(folder)
    result = subprocess.run(
        [sys.executable, str(ROOT / "nanospec.py"), *args], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
