"""What every /api/v1 view shares: the one DRF exception handler and the org-scoped base view.

A package of the platform, not of one app (HackSoft's styleguide keeps these in an ``api``
app): every app's ``apis.py`` builds on it, so it may import only what all of them may.
"""
