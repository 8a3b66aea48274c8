"""zephon_loader: packed token batches from Zephon pipelines for NeMo AutoModel-style models."""
