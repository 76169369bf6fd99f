"""What the README, the docs and the examples tell a user to run holds."""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What a user is told to run: the changelog, which quotes what was wrong, is not.
TEXTS = sorted(
    path
    for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").rglob("*.yml"),
                 *(ROOT / "examples").rglob("*.py")]
    if path.name != "changelog.md"
)


def pip_installs():
    """``(file, line number, requirements)`` of every ``pip install`` command in the texts."""
    for path in TEXTS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for command in re.findall(r"pip install ([^`#\n]*)", line):
                try:
                    words = shlex.split(command)
                except ValueError:  # a command cut by the prose around it
                    words = command.split()
                yield path.relative_to(ROOT), number, [w for w in words if not w.startswith("-")]


def test_the_docs_install_tigon_from_a_checkout_or_a_wheel():
    # tigon is not on PyPI: a bare `tigon` or `tigon[extra]` requirement finds nothing there.
    from_index = [
        f"{path}:{number}: {requirement}"
        for path, number, requirements in pip_installs()
        for requirement in requirements
        if re.fullmatch(r"tigon(\[[\w,]+\])?([<>=!~].*)?", requirement)
    ]
    assert not from_index, "pip install of tigon from the index, where it is not:\n" + "\n".join(from_index)


def test_python_m_build_which_the_readme_names_is_in_the_dev_extra():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and newer
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "python -m build" in (ROOT / "README.md").read_text()
    assert any(re.match(r"build\b", requirement) for requirement in extras["dev"])
