"""One function per protocol action, and the bounded output reads.

Modules are imported by their own path; this package re-exports nothing, so a test
that patches a module patches the code that runs.
"""
