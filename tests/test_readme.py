"""The README's and the docs' examples: every Python block runs as written, and every shell example names a
make target, an entry point, a module or a file that exists."""

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(lang):
    return [
        (f"{page.relative_to(ROOT)} {lang} block {i}", code)
        for page in PAGES
        for i, code in enumerate(re.findall(rf"```{lang}\n(.*?)```", page.read_text(), re.DOTALL))
    ]


PYTHON = _blocks("python")
SHELL = _blocks("bash")
# commands written inline in the prose: `make bench`, `python -m bench.models.generate --workloads real`, ...
COMMAND = r"`((?:make|python3? -m|python3? scripts/|grpo-fast|bash bench/)[^`]*)`"
INLINE = [
    (f"{page.relative_to(ROOT)}: {m}", m)
    for page in PAGES
    for m in (" ".join(x.split()) for x in re.findall(COMMAND, page.read_text()))  # wrapped in the prose
]
MAKE_TARGETS = set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))
CLI_COMMANDS = {"train", "estimate", "serve"}  # grpo_fast/cli.py


@pytest.mark.parametrize("name,code", PYTHON, ids=[n for n, _ in PYTHON])
def test_python_block_runs(name, code):
    exec(compile(code, name, "exec"), {"__name__": "__readme__"})


def _commands(code):
    """Each shell command of a block: continuation lines joined, comments and `$(...)` substitutions out."""
    joined = re.sub(r"\\\n\s*", " ", code)
    for line in joined.splitlines():
        line = re.sub(r'"\$\([^)]*\)"|\$\([^)]*\)', "X", line.split(" #")[0]).strip()
        if line and not line.startswith("#"):
            yield shlex.split(line)


def _module_exists(name):
    if (ROOT / (name.replace(".", "/") + ".py")).is_file() or (ROOT / name.replace(".", "/")).is_dir():
        return True
    return importlib.util.find_spec(name.split(".")[0]) is not None and importlib.util.find_spec(name)


def _check(argv):
    """A reason the command names nothing that exists, or None."""
    tool, args = argv[0], argv[1:]
    if tool == "make":
        missing = [t for t in args if not t.startswith("-") and "=" not in t and t not in MAKE_TARGETS]
        return f"make targets {missing} are not in the Makefile" if missing else None
    if tool == "grpo-fast":
        return None if args and args[0] in CLI_COMMANDS else f"grpo-fast has no command {args[:1]}"
    if tool in ("python", "python3", "torchrun"):
        if "-m" in args:
            module = args[args.index("-m") + 1]
            return None if _module_exists(module) else f"no module {module}"
        script = next((a for a in args if a.endswith(".py")), None)
        return None if script is None or (ROOT / script).is_file() else f"no file {script}"
    if tool == "bash":
        return None if (ROOT / args[0]).is_file() else f"no file {args[0]}"
    return None  # pip, export and the like: nothing of ours to check


@pytest.mark.parametrize("name,code", SHELL, ids=[n for n, _ in SHELL])
def test_shell_block_names_what_exists(name, code):
    problems = [f"{' '.join(c)}: {why}" for c in _commands(code) if (why := _check(c))]
    assert not problems, problems


@pytest.mark.parametrize("name,code", INLINE, ids=[n for n, _ in INLINE])
def test_inline_command_names_what_exists(name, code):
    problems = [f"{' '.join(c)}: {why}" for c in _commands(code) if (why := _check(c))]
    assert not problems, problems


def test_pages_have_examples_and_the_readme_is_short():
    assert PYTHON and SHELL and INLINE
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
