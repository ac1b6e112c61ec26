# The source budget (README, "Files"), counted as the formatter writes the code: comments,
# docstrings and blank lines are free, so explanations never compete with code for room. Packing
# lines cannot make room either: `ruff format` (make test checks it) undoes packing.
import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
NOT_CODE |= {tokenize.ENDMARKER}


def python_code_lines(path: Path) -> int:
    """Lines holding a token that is neither a comment nor a docstring (a string statement)."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docstrings.update(range(node.lineno, node.end_lineno + 1))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in NOT_CODE:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def c_code_lines(path: Path) -> int:
    """Lines that are neither blank nor a // comment (the C source uses no /* */ comments)."""
    return sum(
        1
        for line in path.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("//")
    )


def test_source_fits_the_budget():
    engine = [
        p
        for p in [*ROOT.glob("*.py"), *ROOT.glob("models/*.py")]
        if p.name != "train_speculator.py"
    ]
    assert {"nanospec.py", "kernels.py", "paged_kv.py", "bench.py", "llama.py"} <= {
        p.name for p in engine
    }
    counts = {
        "the card's modules (top-level *.py but train_speculator.py, models/)": (
            sum(map(python_code_lines, engine)),
            3000,
        ),
        "cpu_kernels.c": (c_code_lines(ROOT / "cpu_kernels.c"), 450),
        "train_speculator.py": (python_code_lines(ROOT / "train_speculator.py"), 200),
    }
    for name, (lines, budget) in counts.items():
        print(f"{name}: {lines} lines of code (budget < {budget})")
    assert all(lines < budget for lines, budget in counts.values()), counts


def test_no_line_over_100_characters():
    sources = [
        *ROOT.glob("*.py"),
        *ROOT.glob("*.c"),
        *ROOT.glob("models/*.py"),
        *ROOT.glob("tests/*.py"),
    ]
    too_long = [
        (p.name, i + 1)
        for p in sources
        for i, line in enumerate(p.read_text().splitlines())
        if len(line) > 100
    ]
    assert too_long == []


def test_the_engine_class_stays_small_enough_to_hold():
    """LLMEngine is the step and what it needs; everything else lives beside what it serves
    (README, "A tour"). Its lines as they stand in the file, comments and docstrings included."""
    tree = ast.parse((ROOT / "nanospec.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLMEngine")
    lines = engine.end_lineno - engine.lineno + 1
    print(f"LLMEngine: {lines} lines (budget < 200)")
    assert lines < 200
