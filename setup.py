"""Maps the repo's top-level folders onto the `prfaas_sgl` import namespace.

`router/`, `cachepool/` and `kernels/` are installed as `prfaas_sgl.router`, ... because the bare names
exist on PyPI (and transformers probes an installed `kernels` package). Sub-packages are discovered, so no
list is kept in sync by hand.
"""
from setuptools import find_packages, setup

ROOTS = {
    "prfaas_sgl": "prfaas_sgl",
    "prfaas_sgl.router": "router",
    "prfaas_sgl.cachepool": "cachepool",
    "prfaas_sgl.kernels": "kernels",
}


def _packages() -> list[str]:
    out = []
    for name, path in ROOTS.items():
        out.append(name)
        out += [f"{name}.{sub}" for sub in find_packages(path)]
    return out


setup(packages=_packages(), package_dir=dict(ROOTS))
