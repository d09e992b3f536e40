"""Usage events, durable ingest, hourly rollups and rating hooks. Wired, not yet built."""
