"""The composition root, the socket shell, peer credentials and log lines.

Modules are imported by their own path; this package re-exports nothing, so a test
that patches a module patches the code that runs.
"""
