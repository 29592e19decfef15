"""Examples are executed (the README's Python example and bindings-python/README.md),
the typed usage file passes `mypy --strict`, and the suite runs against the installed
wheel."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import oncely
import pytest
from conftest import REPO

HERE = Path(__file__).resolve().parent


def python_blocks(path: Path, section: str | None = None) -> list[str]:
    text = path.read_text(encoding="utf-8")
    if section is not None:
        start = text.index(section)
        end = text.find("\n## ", start + len(section))
        text = text[start : end if end != -1 else None]
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def run_block(code: str, name: str) -> None:
    exec(compile(code, name, "exec"), {"__name__": "__main__"})


def test_installed_wheel_not_source_tree() -> None:
    path = Path(oncely.__file__).resolve()
    assert "site-packages" in path.parts, path
    assert (path.parent / "py.typed").exists()
    assert (path.parent / "_oncely.pyi").exists()


def test_root_readme_python_example() -> None:
    blocks = python_blocks(REPO / "README.md", "## Python")
    assert blocks, "README.md has no Python example"
    for i, code in enumerate(blocks):
        run_block(code, f"README.md#python-{i}")


@pytest.mark.parametrize("index", range(len(python_blocks(REPO / "bindings-python" / "README.md"))))
def test_package_readme_examples(index: int) -> None:
    code = python_blocks(REPO / "bindings-python" / "README.md")[index]
    run_block(code, f"bindings-python/README.md#{index}")


def test_typed_usage_runs() -> None:
    runpy.run_path(str(HERE / "typed_usage.py"), run_name="__main__")


@pytest.mark.timeout(300)
def test_typed_usage_passes_mypy_strict() -> None:
    api = pytest.importorskip("mypy.api")
    out, err, status = api.run(["--strict", "--no-incremental", str(HERE / "typed_usage.py")])
    assert status == 0, out + err
