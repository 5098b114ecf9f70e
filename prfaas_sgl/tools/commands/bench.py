from prfaas_sgl.tools.loadgen.cli import add_parser, run  # noqa: F401
