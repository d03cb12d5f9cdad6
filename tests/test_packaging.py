"""A built wheel (what `pip install grpo-fast` gets) holds every module of the source tree."""

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

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
