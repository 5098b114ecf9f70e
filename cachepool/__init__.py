"""prfaas_sgl.cachepool"""
