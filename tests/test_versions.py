"""
The lowest versions the project claims, checked where that is practical without installing
them: README.md says "Python 3.10+", and every source file must parse as Python 3.10 (ast's
feature_version refuses syntax that came later, e.g. `except*` or `type X = ...`). A newer
standard-library call would still slip through; CI runs the newest Python the machine has.

    python -m pytest tests/test_versions.py -q
"""

import ast
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def claimed_python() -> tuple:
    """(major, minor) from README.md's install line, e.g. "Python 3.10+"."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        found = re.search(r"Python (\d+)\.(\d+)\+", f.read())
    assert found, "README.md states no 'Python X.Y+' line"
    return int(found.group(1)), int(found.group(2))


def project_sources() -> list:
    skip = {".git", ".venv", ".venv-ci", "__pycache__", "runs"}
    paths = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders if name not in skip]
        paths += [os.path.join(folder, name) for name in files if name.endswith(".py")]
    return sorted(paths)


def test_the_claimed_python_is_at_most_the_one_running_the_tests():
    assert claimed_python() <= sys.version_info[:2]


def test_readme_and_requirements_claim_the_same_lowest_torch():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = re.search(r"torch >= ([\d.]+)", f.read())
    with open(os.path.join(ROOT, "requirements.txt"), encoding="utf-8") as f:
        required = re.search(r"^torch>=([\d.]+)", f.read(), re.M)
    assert readme and required and readme.group(1) == required.group(1)


@pytest.mark.parametrize("path", project_sources(), ids=lambda p: os.path.relpath(p, ROOT))
def test_every_source_file_parses_as_the_lowest_claimed_python(path):
    with open(path, encoding="utf-8") as f:
        source = f.read()
    ast.parse(source, filename=path, feature_version=claimed_python())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="needs a Python that parses except*")
def test_an_out_of_range_syntax_is_refused_by_the_check():
    """The check itself can fail: `except*` (3.11) does not parse as 3.10."""
    newer = "try:\n    pass\nexcept* ValueError:\n    pass\n"
    ast.parse(newer)  # fine on the running Python (3.11+)
    with pytest.raises(SyntaxError):
        ast.parse(newer, feature_version=(3, 10))
