"""Pure device ops on logits rows (no host syncs, no Python loops over rows)."""
