"""``python -m prfaas_sgl.launch_router``: the PrfaaS router (no torch, no sglang imported)."""

from prfaas_sgl.router.main import main

if __name__ == "__main__":
    main()
