# The interactive chat, driven as a person would: `nanospec.py --chat` without --prompt in a
# pseudo-terminal (so it streams and colours), two turns typed in, the screen read back. The second
# turn's prompt extends the first's prompt and answer, so prefix caching must find them cached.
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tiny

ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 4
# the char tokenizer has no special tokens: a template of plain text
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}a: {% endif %}"
)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# the line after each answer
STATS = re.compile(
    r"(\d+) tokens, [\d.]+ tok/s, mean accepted length ([\d.]+), prompt (\d+) tokens, (\d+) cached"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat")
    tiny.write_checkpoint(path, tiny.llama_like())
    tiny.write_char_tokenizer(path, chat_template=TEMPLATE)
    return path


class Terminal:
    """A process on the slave side of a pty; reads everything it writes, as a screen would."""

    def __init__(self, args: list[str]):
        master, slave = os.openpty()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "TERM": "xterm-256color"}
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "nanospec.py"), *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            cwd=ROOT,
        )
        os.close(slave)
        self.fd, self.raw = master, b""

    def screen(self) -> str:
        return ANSI.sub("", self.raw.decode(errors="replace")).replace("\r", "")

    def wait_for(self, pattern: re.Pattern, count: int, timeout: float = 120) -> list:
        """Read until pattern has matched count times on the screen; returns the matches."""
        deadline = time.monotonic() + timeout
        while len(found := pattern.findall(self.screen())) < count:
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern.pattern!r} x{count} on the screen:\n{self.screen()}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # EIO: the process closed the terminal
                    chunk = b""
                assert chunk, f"the chat exited early:\n{self.screen()}"
                self.raw += chunk
        return found

    def type(self, text: str):
        os.write(self.fd, text.encode())

    def finish(self, timeout: float = 60) -> int:
        try:
            while select.select([self.fd], [], [], timeout)[0]:  # drain until the pty closes
                self.raw += os.read(self.fd, 65536)
        except OSError:
            pass
        os.close(self.fd)
        return self.proc.wait(timeout)


def chat(model, *flags) -> Terminal:
    return Terminal(
        ["--model", str(model), "--chat", "--dtype", "float32", "--block-size", str(BLOCK_SIZE)]
        + ["--max-tokens", "12", "--ignore-eos", *flags]
    )


def test_two_turns_the_second_finds_the_first_cached(model):
    term = chat(model, "--draft", "suffix", "--num-spec-tokens", "3")
    term.type("hello there\n")
    (tokens1, _, prompt1, cached1), *_ = term.wait_for(STATS, 1)
    term.type("and once more\n")
    _, (tokens2, _, prompt2, cached2) = term.wait_for(STATS, 2)
    term.type("/reset\n")
    term.type("hello there\n")
    *_, (_, _, prompt3, cached3) = term.wait_for(STATS, 3)
    term.type("/exit\n")
    assert term.finish() == 0
    tokens1, prompt1, cached1, prompt2, cached2 = map(
        int, (tokens1, prompt1, cached1, prompt2, cached2)
    )
    assert tokens1 == 12 and cached1 == 0
    # Every token of turn 1 but the last sampled one (which never had K/V computed) is cached.
    # The issue asks for prompt + answer rounded down to whole blocks; that cannot hold when
    # prompt + answer ends exactly on a block boundary: the last block then holds the last
    # sampled token, whose K/V no step computes (it would be the input of the next step, and the
    # request finished), so that block is never full of computed K/V and never keyed. Otherwise
    # both bounds round to the same block. (Only when the request stops inside accepted drafts is
    # its last token's K/V computed: the verify step fed it in.)
    computed = prompt1 + tokens1 - 1
    assert prompt2 > prompt1 + tokens1
    assert cached2 >= computed // BLOCK_SIZE * BLOCK_SIZE, (prompt1, tokens1, cached2)
    # /reset starts the conversation over: the same first prompt, now cached as far as it can be
    assert int(prompt3) == prompt1 and int(cached3) == (prompt1 - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert "\x1b[" in term.raw.decode(errors="replace")  # a terminal gets colour


def test_ctrl_d_ends_the_chat_and_no_color_is_plain(model):
    term = chat(model, "--no-color")
    term.type("hi\n")
    term.wait_for(STATS, 1)
    term.type("\x04")
    assert term.finish() == 0
    assert "\x1b[3" not in term.raw.decode(errors="replace")  # no foreground colours


def test_chat_with_piped_stdin_prints_plain_text(model):
    """Not a terminal: the same conversation, plain text, one stats line per answer."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "nanospec.py"), "--model", str(model), "--chat"]
        + ["--dtype", "float32", "--max-tokens", "6", "--ignore-eos"],
        input="hello\nagain\n",
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert len(STATS.findall(out.stdout)) == 2 and "\x1b[" not in out.stdout
