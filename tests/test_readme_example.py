"""The README's "Pattention in your own code" example runs verbatim: a plain PyTorch module of Pattentions trains,
grows and asserts that growth kept its output."""

from tests.conftest import REPO

HEADING = "## Pattention in your own code"


def test_the_readme_pattention_example_runs():
    section = (REPO / "README.md").read_text(encoding="utf-8").split(HEADING, 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(example.splitlines()) <= 15
    exec(compile(example, "README.md", "exec"), {})
