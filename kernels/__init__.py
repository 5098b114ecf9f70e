"""prfaas_sgl.kernels"""
