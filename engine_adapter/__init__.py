"""The only code that talks to inference engines: fleet, router, engine client, simulator."""
