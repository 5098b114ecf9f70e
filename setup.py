"""Maps the repo's top-level folders onto the `prfaas_sgl` import namespace, and ships the boot `.pth`.

`router/`, `cachepool/` and `kernels/` are installed as `prfaas_sgl.router`, ... because the bare names
exist on PyPI (and transformers probes an installed `kernels` package). Sub-packages are discovered, so no
list is kept in sync by hand. `scenarios/` is installed as `prfaas_sgl.scenarios` with its TOML files as
package data: the simulator's studies read them from the installed package, not from a repository checkout.
`deploy/monitoring/` is installed as `prfaas_sgl.monitoring` with its alert rules, for `prfaas render prometheus`.

`prfaas_sgl_boot.pth` must sit at the top of site-packages: SGLang's scheduler subprocess imports modules
that do `from sgl_kernel import ...` before its plugin loader runs, so the CPU stand-in for `sgl_kernel`
has to be findable from interpreter start. The line it runs only installs a lazy meta-path finder.
"""
import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

ROOTS = {
    "prfaas_sgl": "prfaas_sgl",
    "prfaas_sgl.router": "router",
    "prfaas_sgl.cachepool": "cachepool",
    "prfaas_sgl.kernels": "kernels",
    "prfaas_sgl.scenarios": "scenarios",
    "prfaas_sgl.monitoring": "deploy/monitoring",
}
PACKAGE_DATA = {"prfaas_sgl.scenarios": ["*.toml"], "prfaas_sgl.monitoring": ["alerts.yml"]}
PTH = "prfaas_sgl_boot.pth"


def _packages() -> list[str]:
    out = []
    for name, path in ROOTS.items():
        out.append(name)
        out += [f"{name}.{sub}" for sub in find_packages(path)]
    return out


class BuildWithPth(build_py):
    """Copies the boot `.pth` next to the packages (also in editable builds, where build_lib is the wheel root)."""

    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


class _AddPth:
    """Wraps setuptools' editable strategy: its wheel gets our `.pth` at the top level as well."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, wheel, files, mapping):
        self.inner(wheel, files, mapping)
        with open(PTH, encoding="utf-8") as f:
            wheel.writestr(PTH, f.read())

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


class EditableWithPth(editable_wheel):
    # `_select_strategy` is setuptools-internal; build-system.requires pins the range it exists in.
    def _select_strategy(self, name, tag, build_lib):
        return _AddPth(super()._select_strategy(name, tag, build_lib))


setup(
    packages=_packages(),
    package_dir=dict(ROOTS),
    package_data=PACKAGE_DATA,
    cmdclass={"build_py": BuildWithPth, "editable_wheel": EditableWithPth},
)
