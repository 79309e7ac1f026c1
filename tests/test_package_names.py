"""The project's top-level packages shadow no installed distribution's module.

The tests and ``python -m`` run with the repository first on ``sys.path``, so a top-level package of
ours named like another distribution's module hides that module from every library that imports it.
For example, transformers 5.25 depends on Hugging Face's ``kernels`` distribution and imports
``kernels.CUDAProperties`` when it loads a model: a package of ours called ``kernels`` makes every
transformers model fail to load on a fresh install, while an older environment passes.
Every package the install made is checked, so a new dependency that brings a clashing name fails here,
on the machine that installed it, naming both sides.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OURS = "asyncrl"


def our_top_level_packages() -> set[str]:
    found = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    return {pattern.rstrip("*") for pattern in found}


def test_the_package_list_is_the_repository_s_packages() -> None:
    on_disk = {p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name != "tests"}
    assert our_top_level_packages() == on_disk


def test_no_installed_distribution_provides_a_module_named_like_ours() -> None:
    providers = importlib.metadata.packages_distributions()
    clashes = {
        name: sorted(set(providers[name]) - {OURS})
        for name in our_top_level_packages()
        if set(providers.get(name, ())) - {OURS}
    }
    assert not clashes, (
        f"these top-level packages of the project hide modules of installed distributions: {clashes}; "
        "rename the project's package (the other distribution's users import it by that name)"
    )
