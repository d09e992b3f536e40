"""The web console: customers' pages (sign-up, organizations, projects, API keys, members)."""
