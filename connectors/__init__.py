"""batchgen.connectors"""
