"""SGLang plugin entry point (group `sglang.srt.plugins`)."""


def register() -> None:
    """Called by `sglang.srt.plugins.load_plugins()` in every SGLang process; must stay cheap."""
    from prfaas_sgl import compat

    compat.install()
