"""The manual builds (`mkdocs build --strict`: a broken link, anchor or missing page fails), its
generated reference pages match the code, every config key and logged metric is explained, the
README stays a front page, and the changelog's release is the package's version."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from meshrl.cli import docs
from meshrl.configs.keys import config_keys

REPO = Path(__file__).resolve().parents[1]


def test_the_manual_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


def test_generated_reference_pages_are_current():
    """Rewrite them with `python -m meshrl.cli.docs` after changing the schema, CLI or glossary."""
    for name, render in docs.PAGES.items():
        assert (docs.REFERENCE / name).read_text() == render(), f"docs/reference/{name} is stale"


def test_every_config_key_has_a_meaning_on_the_config_page():
    page = (docs.REFERENCE / "config.md").read_text()
    for key in config_keys():
        assert key.description, f"config key {key.key} has no description"
        assert f"| `{key.key}` |" in page


def test_the_readme_is_a_front_page_without_issue_numbers():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    pages = [readme, *(p.read_text() for p in (REPO / "docs").rglob("*.md"))]
    for text in pages:
        assert not re.search(r"\bissues? #\d|\(#\d+\)|#\d+'s\b", text, re.IGNORECASE)


def test_the_changelog_names_the_installed_version():
    changelog = (REPO / "CHANGELOG.md").read_text()
    released = re.search(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", changelog, re.MULTILINE)
    assert released, "CHANGELOG.md has no '## [X.Y.Z] - YYYY-MM-DD' release"
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert released.group(1) == version == importlib.metadata.version("meshrl")
