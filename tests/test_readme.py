"""The README's Python examples run as written."""

import re
from pathlib import Path

import pytest

BLOCKS = re.findall(
    r"```python\n(.*?)```", (Path(__file__).resolve().parent.parent / "README.md").read_text(), re.DOTALL
)


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_python_block_runs(i):
    exec(compile(BLOCKS[i], f"README.md python block {i}", "exec"), {"__name__": "__readme__"})


def test_readme_has_examples():
    assert BLOCKS
