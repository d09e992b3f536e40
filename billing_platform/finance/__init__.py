"""The platform's finance workspace: reports across organizations and finance's operations."""
