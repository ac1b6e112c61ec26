# Streaming text: incremental detokenization never shows half a multi-byte character, and the
# pieces joined are exactly the text a whole decode gives.
import pytest
import tiny
from hypothesis import given, settings
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
    """Any ids, valid UTF-8 or not: the stream's text is the whole decode's."""
    start = min(start, len(ids))
    assert "".join(pieces(tokenizer, ids, start)) == tokenizer.decode(ids[start:])


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab é€😀", max_size=20))
def test_no_piece_holds_half_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text) or not set(text) - set("ab ")  # the characters span tokens
    parts = pieces(tokenizer, ids)
    assert "".join(parts) == text and not any("\ufffd" in p for p in parts)
