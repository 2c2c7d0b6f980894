"""batchgen.engine.models"""
