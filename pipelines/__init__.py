"""batchgen.pipelines"""
