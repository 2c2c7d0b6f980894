"""CPU stage: generated token ids -> text, and the split stages' columns -> the output contract.

Decodes exactly as the engine does (`engine.stop_checker.detokenize`), cut where the decode
stage reports a stop string ended the text, then emits the columns of `operators.columns` and
drops the hand-off columns.
"""

from __future__ import annotations

from typing import Any

from batchgen.connectors.checkpoint_files import load_tokenizer
from batchgen.engine import Completion, Result
from batchgen.engine.stop_checker import detokenize
from batchgen.operators import stage_columns as sc
from batchgen.operators.blocks import Block, column_values, to_block, with_columns, without_columns
from batchgen.operators.columns import ERROR, RowOutcome, output_columns


class Detokenize:
    def __init__(self, model: str, *, storage_options: dict[str, Any] | None = None,
                 list_outputs: bool = False) -> None:
        self.tokenizer = load_tokenizer(model, storage_options)
        self.list_outputs = list_outputs

    def __call__(self, batch: Any) -> Block:
        block = to_block(batch)
        values = {name: column_values(block, name) for name in
                  (sc.PROMPT_IDS, sc.GENERATED_IDS, sc.FINISH_REASONS, sc.TEXT_ENDS, sc.COMPLETION_S, ERROR)}
        outcomes = []
        for prompt, samples, reasons, ends, seconds, error in zip(*values.values()):
            if error is not None or samples is None:
                prompt_tokens = len(prompt) if prompt else None
                outcomes.append(RowOutcome(error=error or "no result", num_prompt_tokens=prompt_tokens))
                continue
            texts = [detokenize(self.tokenizer, ids)[:end] for ids, end in zip(samples, ends)]
            completions = [Completion(i, ids, text, reason)
                           for i, (ids, text, reason) in enumerate(zip(samples, texts, reasons))]
            result = Result("", prompt, completions, submitted_at=0.0, finished_at=seconds)
            outcomes.append(RowOutcome(result))
        block = without_columns(block, (*sc.ALL, ERROR))  # `error` goes back in its contract place
        return with_columns(block, output_columns(outcomes, self.list_outputs))
