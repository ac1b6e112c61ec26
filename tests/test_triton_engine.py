# End to end through the Triton kernels (run by the interpreter on CPU, for real on CUDA where there
# is a GPU): tiny Llama and OPT models generate exactly the same greedy tokens as on the CPU's
# path, with speculation so that verify-shaped multi-token steps and block-crossing lookahead run
# in Triton.
import pytest
import tiny
from test_kernels import DEVICE

import kernels
from nanospec import LLM, SamplingParams

PROMPTS = [[5, 9, 14, 5, 9], [7, 3, 22]]


@pytest.mark.parametrize(
    "config",
    [
        lambda: tiny.llama_like(
            hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2
        ),
        lambda: tiny.opt(hidden_size=32, ffn_dim=48, num_attention_heads=2, word_embed_proj_dim=32),
    ],
    ids=["llama", "opt"],
)
def test_triton_path_generates_the_same_tokens(config, tmp_path, monkeypatch):
    tiny.write_checkpoint(tmp_path, config())
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def generate(device="cpu"):
        llm = LLM(
            str(tmp_path),
            device=device,
            dtype="float32",
            block_size=4,
            num_blocks=16,
            draft=str(tmp_path),
            num_spec_tokens=2,
        )
        # the pool is uninitialized memory: no kernel may read a slot before it is written
        for cache in llm.kv_caches:
            cache.fill_(float("nan"))
        outs = llm.generate(PROMPTS, params, use_progress=False)
        assert sum(o.num_accepted_tokens for o in outs) > 0  # verify steps of K+1 = 3 queries ran
        return [o.token_ids for o in outs]

    expected = generate()
    monkeypatch.setattr(kernels, "FORCE_TRITON", True)
    calls = {"paged_attention": [], "linear": [], "rotary_store": []}  # each call's rows

    def counting(fn, rows):  # records each call's row count, then runs the kernel
        return lambda *a: rows.append(len(a[0])) or fn(*a)

    for op, rows in calls.items():
        monkeypatch.setattr(
            kernels, f"triton_{op}", counting(getattr(kernels, f"triton_{op}"), rows)
        )
    assert generate(DEVICE) == expected
    assert max(calls["paged_attention"]) >= 3, "no verify-shaped attention call went through Triton"
    assert max(calls["linear"]) >= 3, "no verify-shaped linear went through Triton"
    assert max(calls["rotary_store"]) >= 3, "no verify-shaped K/V store went through Triton"
