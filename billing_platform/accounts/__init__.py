"""Tenancy: users, organizations, memberships and roles, projects, API keys, invitations."""
