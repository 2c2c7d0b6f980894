"""batchgen.kernels"""
