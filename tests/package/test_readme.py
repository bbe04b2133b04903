"""The runnable snippets of the README and docs/ run as written and print what the page says they print."""

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
DOCUMENTS = [README, *sorted((README.parent / "docs").glob("*.md"))]   # snippets moved out of the README


def _blocks(lang, documents=(README,)):
    return [block for path in documents for block in re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)]


def _run_snippet(marker, documented_pattern, documents=DOCUMENTS):
    """Run the one python block of ``documents`` containing ``marker``; return (its printed lines, the
    documented output)."""
    (snippet,) = [b for b in _blocks("python", documents) if marker in b]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, "README.md", "exec"), {})
    return out.getvalue().splitlines(), re.search(documented_pattern, snippet).group(1)


def test_plan_snippet_runs_and_prints_the_documented_numbers():
    printed, documented = _run_snippet("make_plan", r"# (\d+ \d+ \d+x)")
    assert printed[0] == documented


def test_aggregator_snippet_runs_as_written_and_prints_the_documented_figures():
    printed, documented = _run_snippet("optimizer_step(optimizer, powersgd)", r"# (\d+ [\d.]+ [\d.]+x)\n", (README,))
    assert printed[-1] == documented


def test_setup_commands_name_files_that_exist():
    root = README.parent
    commands = [line.split("#")[0].strip() for block in _blocks("bash") for line in block.splitlines()]
    assert "bash scripts/run gradpress demo" in commands
    assert "bash scripts/run python3 -m pytest" in commands
    assert (root / "scripts" / "run").exists() and (root / "scripts" / "setup.sh").exists()
    assert "bash scripts/run python3 -m pytest" in (root / ".ci" / "run").read_text()   # CI runs the README's
