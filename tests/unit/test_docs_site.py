"""The documentation site (mkdocs.yml, docs/) builds in strict mode: a broken link, a page missing from the nav or
an unknown anchor fails the build, and so this test, which the README's test command runs (a few seconds)."""

from __future__ import annotations

import shutil

from tests.support.docs_site import REPO, build_site


def test_the_site_builds_strictly(tmp_path):
    proc = build_site(tmp_path / "site")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "search" / "search_index.json").exists()


def test_a_broken_link_fails_the_strict_build(tmp_path):
    """The check above could fail: a page linking to a page that does not exist is refused."""
    docs = tmp_path / "docs"
    shutil.copytree(REPO / "docs", docs)
    (docs / "index.md").write_text((docs / "index.md").read_text() + "\n[nowhere](no-such-page.md)\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"INHERIT: {REPO / 'mkdocs.yml'}\ndocs_dir: {docs}\n")
    proc = build_site(tmp_path / "site", config)
    assert proc.returncode != 0
    assert "no-such-page.md" in proc.stdout + proc.stderr
