# The source budget (README, "Files"): every line of source a reader may need, C included and tests
# excluded, stays under 3,000 lines, none longer than 110 characters.
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_source_fits_the_budget():
    sources = sorted([*ROOT.glob("*.py"), *ROOT.glob("*.c"), *ROOT.glob("models/*.py")])
    assert {"nanospec.py", "kernels.py", "cpu_kernels.c", "bench.py", "llama.py"} <= {p.name for p in sources}
    lines = {p.name: p.read_text().splitlines() for p in sources}
    assert sum(map(len, lines.values())) < 3000, {name: len(text) for name, text in lines.items()}
    too_long = [(name, i + 1) for name, text in lines.items() for i, line in enumerate(text) if len(line) > 110]
    assert too_long == []
