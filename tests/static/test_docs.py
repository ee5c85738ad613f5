"""The documentation: its generated pages are current, the site builds strictly (a broken link
or anchor fails), and the README stays a user's page that points into it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from .conftest import ROOT, run

README_MAX_LINES = 200


def test_generated_pages_and_pictures_are_current() -> None:
    for script in ("docs/gen/api_reference.py", "docs/gen/pictures.py"):
        done = run(sys.executable, script, "--check")
        assert done.returncode == 0, f"{script}: {done.stderr} (run `make docs`)"


def test_the_api_reference_covers_every_spec_field_and_condition_reason() -> None:
    from disagg_operator.condition_reasons import REASONS
    from disagg_operator.crd import build_crd

    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

    def fields(node: dict, path: str) -> list[str]:
        found = []
        for name, child in (node.get("properties") or {}).items():
            found.append(f"{path}.{name}")
            target = child.get("items") if child.get("type") == "array" else child
            found += fields(target or {}, f"{path}.{name}")
        return found

    for field in fields(schema["properties"]["spec"], "spec"):
        name = field.rsplit(".", 1)[1]
        assert f"| `{name}` |" in page, field
    conditions = (ROOT / "docs" / "reference" / "conditions.md").read_text()
    assert all(f"| `{r.name}` |" in conditions for r in REASONS)


def test_the_site_builds_strictly(tools: Path, tmp_path: Path) -> None:
    done = run(tools / "mkdocs", "build", "--strict", "--site-dir", tmp_path / "site",
               env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(tools)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "api" / "index.html").exists()


def test_the_site_build_fails_on_a_broken_link(tools: Path, tmp_path: Path) -> None:
    """The negative control of the strict build: one link to a page that does not exist."""
    config = (ROOT / "mkdocs.yml").read_text()
    docs = tmp_path / "docs"
    run("cp", "-r", ROOT / "docs", docs)
    (docs / "index.md").write_text((docs / "index.md").read_text() + "\n[x](nowhere.md)\n")
    (tmp_path / "mkdocs.yml").write_text(config)
    done = run(tools / "mkdocs", "build", "--strict", "-f", tmp_path / "mkdocs.yml",
               "--site-dir", tmp_path / "site",
               env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(tools)})
    assert done.returncode != 0 and "nowhere.md" in done.stderr


def test_the_readme_is_short_and_its_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to a missing {target}"
    assert "make run" in text and "make test" in text
