"""Offline preference optimization (DPO and its relatives): pair-keeping micro-batches, the loss a
trainer calls on them, reference log-probs computed once, and the loop."""
