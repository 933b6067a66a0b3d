"""The payload gate: its checks, its reader of the live process's evidence, and what
it expects of the payload.

Modules are imported by their own path; this package re-exports nothing, so a test
that patches a module patches the code that runs.
"""
