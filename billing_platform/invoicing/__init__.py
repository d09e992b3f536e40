"""Billing periods, immutable invoices, credits and Stripe payments. Wired, not yet built."""
