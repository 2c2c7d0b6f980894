"""One engine over several ranks (one process per device): data-parallel attention, expert-parallel MoE."""
