"""SGLang plugin entry point (group `sglang.srt.plugins`).

It stays here, outside the SGLang boundary package `prfaas_sgl.srt`, because the installed entry point names
`prfaas_sgl.plugin:register` (pyproject.toml): moving it would need every environment reinstalled.
"""


def register() -> None:
    """Called by `sglang.srt.plugins.load_plugins()` in every SGLang process; must stay cheap."""
    from prfaas_sgl.srt import compat

    compat.install()
