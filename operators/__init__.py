"""batchgen.operators"""
