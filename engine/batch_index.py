"""A step's index tensors (token ids, positions, KV slots, page tables), built from the scheduler's Python lists.

`torch.tensor` parses a list of Python ints element by element as a generic sequence: ~70 ns an element on the dev
box (a 512-prompt prefill step's tokens, positions and slots are 5,120 each), where numpy's typed conversion takes
~17 ns; the rest is computed from a few such lists with tensor ops (one per step, not one per prompt).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


def index_tensor(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype, device=device) for a sequence of Python ints."""
    tensor = torch.from_numpy(np.fromiter(values, dtype=_NUMPY[dtype], count=len(values)))
    return tensor if device.type == "cpu" else tensor.to(device)


def page_table(pages: list[list[int]], device: torch.device) -> torch.Tensor:
    """Rows of page ids [rows, longest] int32, right-padded with 0 (never read past a row's length)."""
    width = max(len(p) for p in pages)
    flat: list[int] = []
    padding = [0] * width
    for row in pages:
        flat += row
        flat += padding[len(row) :]
    return index_tensor(flat, device, torch.int32).view(len(pages), width)


def span_positions(starts: list[int], lengths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The spans [start, start + length) of rows 0, 1, ... laid end to end: each token's row and position."""
    length, total = index_tensor(lengths, device), sum(lengths)  # the total known here: no device sync for it
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=device), length, output_size=total)
    shift = index_tensor(starts, device) - (torch.cumsum(length, 0) - length)  # position - token index, per row
    return rows, torch.arange(total, device=device) + shift[rows]


def token_slots(table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """The KV slot (page * page_size + offset) of each token: its position's page in its row of `table`."""
    return table[rows, positions // page_size].long() * page_size + positions % page_size


def new_token_slots(table: torch.Tensor, kv_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """The slot of each row's next token (at position kv_len, one token per row of `table`)."""
    return token_slots(table, torch.arange(table.shape[0], device=table.device), kv_lens, page_size)
