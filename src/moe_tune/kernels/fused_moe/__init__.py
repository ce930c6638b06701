"""Fused MoE kernels: the dispatch gather fused into the gate/up grouped matmul (`gather_gmm`, with the gated
activation in its epilogue) and the combine fused into the down projection (`gmm_combine`). See `base.py`
for the backend contract and `op.py` for the public ops."""
