"""Package discovery for the layout in pyproject.toml: `backends/` and `tuning_cache/` sit at
the repository root but install inside the `gdr_dispatch` namespace. setuptools' own `find`
cannot rename a root, so the packages under each root are found here (never listed by hand:
a new subpackage ships without an edit). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

ROOTS = {"gdr_dispatch": "gdr_dispatch", "gdr_dispatch.backends": "backends", "gdr_dispatch.tuning_cache": "tuning_cache"}


def packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


setup(packages=packages(), package_dir=ROOTS)
