"""batchgen.operators: the engine hosted inside Ray Data (map_batches callables)."""

from batchgen.operators.batch_gen import BatchGen
from batchgen.operators.decode import Decode
from batchgen.operators.detokenize import Detokenize
from batchgen.operators.engine_actor import engine_actor_pool
from batchgen.operators.prefill import Prefill
from batchgen.operators.tokenize import Tokenize

__all__ = ["BatchGen", "Decode", "Detokenize", "Prefill", "Tokenize", "engine_actor_pool"]
