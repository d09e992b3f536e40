"""The OpenAI Batch API: files, batches, and the runner that fills the fleet's troughs."""
