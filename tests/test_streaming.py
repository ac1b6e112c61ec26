# Streaming text: incremental detokenization never shows half a multi-byte character, and the
# pieces joined are exactly the text a whole decode gives.
import pytest
import tiny
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from models import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("bytes")
    tiny.write_char_tokenizer(path, multibyte=True)
    return Tokenizer(str(path))


def pieces(tokenizer, ids: list[int], start: int = 0) -> list[str]:
    """decode_next after each token from start on, then the final call, as a stream would."""
    out, offsets = [], (start, start)
    for n in range(start + 1, len(ids) + 1):
        text, offsets = tokenizer.decode_next(ids[:n], *offsets)
        out.append(text)
    return out + [tokenizer.decode_next(ids, *offsets, final=True)[0]]


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(1, tiny.VOCAB - 1), max_size=30), start=st.integers(0, 5))
def test_pieces_join_to_the_whole_decode(tokenizer, ids, start):
    """Random ids whose bytes are valid UTF-8: the stream's text is the whole decode's. (Invalid
    bytes may differ: byte fallback then replaces every byte of a run, a stream only the bad
    ones. The engine's final text is the stream's, so deltas always join to it.)"""
    start = min(start, len(ids))
    assume("\ufffd" not in tokenizer.decode(ids[start:]))
    assert "".join(pieces(tokenizer, ids, start)) == tokenizer.decode(ids[start:])


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab é€😀", max_size=20))
def test_no_piece_holds_half_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text) or not set(text) - set("ab ")  # the characters span tokens
    parts = pieces(tokenizer, ids)
    assert "".join(parts) == text and not any("\ufffd" in p for p in parts)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from nanospec import LLM

    path = tmp_path_factory.mktemp("model")
    tiny.write_checkpoint(path, tiny.llama_like())
    tiny.write_char_tokenizer(path, multibyte=True)
    return LLM(
        str(path), dtype="float32", block_size=4, num_blocks=128, draft="ngram", num_spec_tokens=4
    )


def test_streamed_deltas_join_to_the_final_text(engine):
    """Eight requests at once, with and without stop strings, speculating, on a tokenizer whose
    random output splits characters across tokens: each request's deltas join to its text (which
    a stop string cut short: so no delta ever held any of it), and its token ids to its ids."""
    from nanospec import SamplingParams

    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = ["hello é world", "€€ and 😀", "abcabcabc", "xyz", "é", "q", "zz", "hello"]
    full = [o.text for o in engine.generate(prompts, free, use_progress=False)]
    stops = [[t[10:13]] if i % 2 else None for i, t in enumerate(full)]
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop) for stop in stops
    ]
    outputs = engine.generate(prompts, params, use_progress=False)
    byte_ids = range(tiny.VOCAB - len(tiny.BYTE_TOKENS), tiny.VOCAB)
    assert any(t in byte_ids for o in outputs for t in o.token_ids)  # bytes the stream must hold
    deltas, ids, finished = [""] * 8, [[] for _ in prompts], []
    for update in engine.generate(prompts, params, stream=True):
        assert update.index not in finished
        deltas[update.index] += update.delta
        ids[update.index] += update.token_ids
        assert len(update.drafted) == len(update.delta)
        if update.finished:
            finished.append(update.index)
            assert update.output.text == deltas[update.index]
    assert sorted(finished) == list(range(8))
    assert deltas == [o.text for o in outputs] and ids == [o.token_ids for o in outputs]
    assert any(stop and o.finish_reason == "stop" for stop, o in zip(stops, outputs))
