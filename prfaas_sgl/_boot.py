"""Interpreter-start hook (run from `prfaas_sgl_boot.pth`): cheap, never raises."""


def install() -> None:
    try:
        from prfaas_sgl.cpu import shim

        shim.install_finder()
    except Exception:  # a broken boot hook must never break an unrelated Python program
        pass
