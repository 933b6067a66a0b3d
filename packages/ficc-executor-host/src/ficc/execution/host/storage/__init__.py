"""Slot filesystems, streamed input files and the per-attempt directories.

Modules are imported by their own path; this package re-exports nothing, so a test
that patches a module patches the code that runs.
"""
