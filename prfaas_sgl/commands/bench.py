from prfaas_sgl.loadgen.cli import add_parser, run  # noqa: F401
