"""Interpreter-start hook (run from `prfaas_sgl_boot.pth`): cheap, never raises.

It stays here, outside the SGLang boundary package `prfaas_sgl.srt`, because the installed `.pth` names
`prfaas_sgl._boot`: moving it would need every environment reinstalled. It only installs `srt.cpu.shim`'s
finder and, in CPU SGLang servers, `srt.cpu.cuda_only`'s.
"""


def install() -> None:
    try:
        from prfaas_sgl.srt.cpu import cuda_only, shim

        shim.install_finder()
        cuda_only.install_finder()
    except Exception:  # a broken boot hook must never break an unrelated Python program
        pass
