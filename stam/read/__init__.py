"""The read path: store-aware retrieval, the store gate, evidence packets, point-in-time state."""
