"""Idempotent POSTs on ``/api/v1``: a retried money-moving request returns its first result.

Clients send ``Idempotency-Key: <unique string>`` as they do to Stripe. The first request with a
key runs and its response is stored with the key, in the same transaction as whatever the view
wrote; a retry with the same key and the same parameters gets that response back (header
``Idempotent-Replayed: true``) and changes nothing; the same key with other parameters is refused
(400). A concurrent retry waits on the first one's row lock and then replays it, so two racing
retries never both charge. A request that fails (an exception, a 5xx) stores nothing: its writes
roll back with the key, and a retry runs it afresh. Keys are kept for 24 hours, per caller.
"""
