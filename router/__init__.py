"""prfaas_sgl.router"""
