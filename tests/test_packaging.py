"""A built wheel (what `pip install grpo-fast` gets) holds every module of the source tree; run from a
checkout, kernels/ never takes the top-level name `kernels` from Hugging Face's kernel hub."""

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from pythons import both_pythons

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="needs setuptools to build")
def test_wheel_holds_every_module(tmp_path):
    src = tmp_path / "src"  # a clean copy: an in-tree build/ would carry modules of earlier builds
    src.mkdir()
    for part in ("pyproject.toml", "README.md", "grpo_fast", "kernels"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        kw = {"ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / part).is_dir() else {}
        copy(ROOT / part, src / part, **kw)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(src)],
        check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("grpo_fast-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"grpo_fast/{p.relative_to(ROOT / 'grpo_fast')}" for p in (ROOT / "grpo_fast").rglob("*.py")}
    expected |= {
        f"grpo_fast/kernels/{p.relative_to(ROOT / 'kernels')}" for p in (ROOT / "kernels").rglob("*.py")
    }
    kinds = ("", ".json", ".jsonl", ".jinja", ".safetensors", ".txt")  # the embedded models, tasks, template
    data = [p for p in (ROOT / "grpo_fast").rglob("*") if p.is_file() and p.suffix in kinds]
    expected |= {f"grpo_fast/{p.relative_to(ROOT / 'grpo_fast')}" for p in data}
    assert not expected - names, sorted(expected - names)


def _from_the_checkout(code, *, extra_path=None, python=sys.executable):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    cmd = [python, "-c", code]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_top_level_name_kernels_is_the_hubs_even_from_the_checkout(tmp_path):
    # `python -m` and pytest put the repository root first on sys.path, where kernels/ would shadow
    # Hugging Face's `kernels` (transformers >= 5.25 imports it at `import transformers.modeling_utils`).
    # A stand-in hub package on PYTHONPATH, behind the root, must be what `import kernels` gives;
    # grpo_fast.kernels stays ours.
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("HUB = 'stand-in'\n")
    (tmp_path / "kernels" / "layer.py").write_text("NAME = 'hub layer'\n")
    done = _from_the_checkout(
        "import kernels, kernels.layer, grpo_fast.kernels as ours\n"
        "print(kernels.HUB, kernels.layer.NAME, ours.__file__, hasattr(ours, 'fused_linear_logprobs'))",
        extra_path=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["stand-in", "hub", "layer", str(ROOT / "kernels" / "__init__.py"), "True"]


@pytest.mark.parametrize("python", both_pythons())
def test_transformers_models_import_from_the_checkout(python):
    """The failure CI met under transformers 5.25 (modeling_utils imports the hub's `kernels`, a dependency
    there); and in the bare environment, transformers 5.17 without the hub, which imports the name to read its
    version: the checkout's package answers with none, and the hub counts as absent."""
    done = _from_the_checkout(
        "import kernels, transformers.modeling_utils, grpo_fast.kernels\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "from importlib.metadata import PackageNotFoundError, version\n"
        "try:\n    version('kernels')\n    hub = True\nexcept PackageNotFoundError:\n    hub = False\n"
        "print(hub, is_kernels_available() == hub, getattr(kernels, '__version__', None) is not None)",
        python=python,
    )
    assert done.returncode == 0, done.stderr
    hub, agrees, has_version = done.stdout.split()
    assert agrees == "True" and has_version == hub, done.stdout


def test_every_name_imported_from_our_packages_exists():
    """Each `from grpo_fast... / bench... / kernels... import name` in the source tree, those inside functions
    included (bench's modules import lazily, so a name lost in a move only fails the day its section runs),
    names something the module has."""
    import ast

    missing = []
    for path in sorted(p for part in ("grpo_fast", "bench", "kernels") for p in (ROOT / part).rglob("*.py")):
        package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = (
                node.module
                if not node.level
                else ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [node.module or ""]
                )
            ).strip(".")
            if base.split(".")[0] not in ("grpo_fast", "bench", "kernels"):
                continue
            if base.startswith("kernels"):
                base = "grpo_fast." + base  # kernels/ is the package grpo_fast.kernels
            module = importlib.import_module(base)
            for alias in node.names:
                if alias.name != "*" and not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{base}.{alias.name}")  # a submodule
                    except ImportError:
                        missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {base}.{alias.name}")
    assert not missing, missing
