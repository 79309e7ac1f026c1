"""Every block the documentation marks runnable is well formed and run by a test (tests/docs/runnable.py)."""

from __future__ import annotations

from tests.docs.runnable import PAGES, REPO, RUN_BY, runnable_blocks


def test_every_runnable_mark_is_before_a_bash_fence_of_a_known_kind() -> None:
    for page in PAGES:
        runnable_blocks(page)  # raises, naming the page and line, on a mark it cannot run


def test_every_page_with_runnable_blocks_has_a_test_that_runs_them() -> None:
    marked = {page for page in PAGES if runnable_blocks(page)}
    assert marked == set(RUN_BY), f"pages with runnable blocks: {sorted(p.name for p in marked)}; run by a test: " \
                                  f"{sorted(p.name for p in RUN_BY)}"
    for page, test in RUN_BY.items():
        assert (REPO / test).is_file() and page.name in (REPO / test).read_text(), f"{test} runs {page.name}"
